use super::*;
use crate::task::{run, ConvertTask};

/// A fresh folder for one test.
fn folder(tag: &str) -> PathBuf {
    crate::testutil::folder(&format!("fverify-{tag}"), &[])
}

/// A safetensors file at `path` of F32 tensors `names`, each of `n` distinct values.
fn f32_file(path: &Path, names: &[&str], n: usize) {
    let mut entries = Vec::new();
    let mut data = Vec::new();
    for (k, name) in names.iter().enumerate() {
        let at = data.len();
        for i in 0..n {
            data.extend(((k * 1000 + i) as f32 * 0.37).to_le_bytes());
        }
        entries.push(format!(
            "\"{name}\":{{\"dtype\":\"F32\",\"shape\":[{n}],\"data_offsets\":[{at},{}]}}",
            data.len()
        ));
    }
    let mut bytes = crate::testutil::file(&format!("{{{}}}", entries.join(",")), 0);
    bytes.extend(data);
    std::fs::write(path, bytes).unwrap();
}

fn bf16() -> Settings {
    Settings {
        to: Some(given_target(Target::Bf16)),
        ..Settings::default()
    }
}

/// Verify DST against SRC with `given`, to the end.
fn verify(src: &Path, dst: &Path, given: &Settings) -> Result<FolderReport> {
    let mut task = FolderVerify::new(src, dst, given, Tuning::default())?;
    run(&mut task)?;
    let (done, total) = task.progress();
    let r = task.finish()?;
    // Progress ends at its total, unless a difference stopped the comparison first.
    assert!(done == total || !r.is_ok(), "{done} of {total}");
    Ok(r)
}

const NAMES: [&str; 6] = [
    "a.weight", "b.weight", "c.weight", "d.weight", "e.bias", "f.weight",
];
const CONFIG: &str = "{\n  \"torch_dtype\": \"float32\",\n  \"hidden_size\": 8\n}\n";

/// An HF folder (weights, model config, tokenizer) and its bf16 conversion, as a folder
/// run writes it: each file converted, the config's dtype set, the tokenizer copied.
fn hf_pair(tag: &str) -> (PathBuf, PathBuf) {
    let (src, dst) = (folder(&format!("{tag}-src")), folder(&format!("{tag}-dst")));
    f32_file(&src.join("model.safetensors"), &NAMES, 32);
    std::fs::write(src.join("config.json"), CONFIG).unwrap();
    std::fs::write(src.join("tokenizer.json"), "{\"v\": 1}").unwrap();
    let opts = bf16().convert(Tuning::default()).unwrap();
    let mut task = ConvertTask::new(
        &src.join("model.safetensors"),
        &dst.join("model.safetensors"),
        &opts,
    )
    .unwrap();
    run(&mut task).unwrap();
    task.seal().unwrap();
    task.publish().unwrap();
    let config = json::config_text(CONFIG, Target::Bf16, false, None).unwrap();
    std::fs::write(dst.join("config.json"), config.unwrap()).unwrap();
    std::fs::copy(src.join("tokenizer.json"), dst.join("tokenizer.json")).unwrap();
    (src, dst)
}

#[test]
fn an_hf_folder_converted_verifies_and_a_changed_file_is_named() {
    let (src, dst) = hf_pair("hf");
    let r = verify(&src, &dst, &Settings::default()).unwrap();
    assert!(r.is_ok(), "{:?}", r.mismatch);
    assert_eq!((r.files, r.parts.len(), r.to), (3, 1, Some(Target::Bf16)));
    assert_eq!(r.tensors_converted, NAMES.len());
    assert!(r.bytes_compared > 0 && r.isa.is_some());
    // A copy that differs, then a file DST holds that SRC does not: each named.
    std::fs::write(dst.join("tokenizer.json"), "{\"v\": 2}").unwrap();
    let (rel, m) = verify(&src, &dst, &Settings::default())
        .unwrap()
        .mismatch
        .unwrap();
    assert_eq!(rel, Path::new("tokenizer.json"));
    assert!(
        m.message.starts_with("differs from the file in SRC"),
        "{}",
        m.message
    );
    std::fs::copy(src.join("tokenizer.json"), dst.join("tokenizer.json")).unwrap();
    std::fs::write(dst.join("notes.txt"), "x").unwrap();
    let (rel, m) = verify(&src, &dst, &Settings::default())
        .unwrap()
        .mismatch
        .unwrap();
    assert_eq!(rel, Path::new("notes.txt"));
    assert!(
        m.message.starts_with("is in DST but not in SRC"),
        "{}",
        m.message
    );
    let loose = Settings {
        loose: true,
        ..Settings::default()
    };
    assert!(verify(&src, &dst, &loose).unwrap().is_ok());
    // A weight file missing from DST.
    std::fs::remove_file(dst.join("model.safetensors")).unwrap();
    let (rel, m) = verify(&src, &dst, &Settings::default())
        .unwrap()
        .mismatch
        .unwrap();
    assert_eq!(rel, Path::new("model.safetensors"));
    assert_eq!(m.message, "is in SRC but not in DST");
}

#[test]
fn a_destination_that_is_no_folder_or_the_source_is_refused() {
    let (src, dst) = hf_pair("refused");
    let missing = dst.join("nothing");
    let e = verify(&src, &missing, &Settings::default()).unwrap_err();
    assert!(
        e.template().ends_with(": no such folder"),
        "{}",
        e.template()
    );
    let file = dst.join("model.safetensors");
    let e = verify(&src, &file, &Settings::default()).unwrap_err();
    assert!(
        e.template().contains("not a folder, while"),
        "{}",
        e.template()
    );
    let e = verify(&src, &src, &Settings::default()).unwrap_err();
    assert!(e.template().ends_with("SRC and DST are the same folder"));
    assert_eq!(e.kind(), ErrorKind::Refused);
}

/// Re-shard the file `src` into DST as convert does, in shards of at most `max` bytes,
/// with the index when there are several; the shards' rels.
fn reshard(src: &Path, dst: &Path, stem: &str, max: u64) -> Vec<String> {
    let s = bf16();
    let group = crate::shard::Group::open(&[src.to_path_buf()], &Default::default()).unwrap();
    let plan = group.plan(max, &s.shard_plan().unwrap()).unwrap();
    let opts = s.shard_convert(Tuning::default()).unwrap();
    let n = plan.shards.len();
    let (mut rels, mut map, mut total) = (Vec::new(), Vec::new(), 0);
    for (i, shard) in plan.shards.iter().enumerate() {
        let rel = format!("{stem}{}", crate::naming::shard_file_name("", i + 1, n));
        let names: Vec<String> = shard
            .tensors
            .iter()
            .map(|&t| group.tensor(t).name.clone())
            .collect();
        let mut task = group
            .task(&names, plan.indexed, &dst.join(&rel), &opts)
            .unwrap();
        run(&mut task).unwrap();
        task.seal().unwrap();
        task.publish().unwrap();
        map.extend(names.into_iter().map(|t| (t, rel.clone())));
        total += shard.data_out;
        rels.push(rel);
    }
    let record = crate::record::own_index_record(src, &dst.join(&rels[0])).unwrap();
    let text = json::index(None, total, Some(&map), true, record.as_deref()).unwrap();
    std::fs::write(dst.join(crate::naming::index_file_name(stem)), text).unwrap();
    rels
}

#[test]
fn a_file_resharded_into_a_folder_verifies_by_tensor_name() {
    let (dir, dst) = (folder("reshard-src"), folder("reshard-dst"));
    let src = dir.join("model.safetensors");
    f32_file(&src, &NAMES, 64);
    let rels = reshard(&src, &dst, "model", 600);
    assert!(rels.len() > 2, "{rels:?}");
    let r = verify(&src, &dst, &Settings::default()).unwrap();
    assert!(r.is_ok(), "{:?}", r.mismatch);
    assert_eq!(r.parts.len(), rels.len());
    assert_eq!(r.files, rels.len() + 1); // the shards and their index
    assert_eq!(r.tensors_converted, NAMES.len());
    // A shard lost: the index names a file DST lacks.
    std::fs::remove_file(dst.join(&rels[1])).unwrap();
    let (rel, m) = verify(&src, &dst, &Settings::default())
        .unwrap()
        .mismatch
        .unwrap();
    assert_eq!(rel.to_str(), Some("model.safetensors.index.json"));
    assert!(m.message.ends_with("which is missing"), "{}", m.message);
}

#[test]
fn a_name_for_several_checkpoints_is_a_usage_error() {
    let (src, dst) = hf_pair("named");
    f32_file(&src.join("other.safetensors"), &NAMES, 4);
    let given = Settings {
        name: Some("model".into()),
        ..Settings::default()
    };
    let e = verify(&src, &dst, &given).unwrap_err();
    assert_eq!(
        (e.kind(), e.option()),
        (ErrorKind::Usage, Some(OptionName::Name))
    );
    assert!(e
        .template()
        .contains("SRC holds 2 (`model.safetensors`, `other.safetensors`)"));
}

/// A sharded HF folder (two shards, their index, a model config) and its bf16 conversion,
/// as a folder run writes it: each shard converted, the index's total set, the config's
/// dtype.
fn sharded_pair(tag: &str) -> (PathBuf, PathBuf) {
    let (src, dst) = (folder(&format!("{tag}-src")), folder(&format!("{tag}-dst")));
    let shards = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    let (first, second) = NAMES.split_at(3);
    f32_file(&src.join(shards[0]), first, 16);
    f32_file(&src.join(shards[1]), second, 16);
    let map: Vec<(String, String)> = first
        .iter()
        .map(|n| (n.to_string(), shards[0].to_string()))
        .chain(
            second
                .iter()
                .map(|n| (n.to_string(), shards[1].to_string())),
        )
        .collect();
    let text = json::index(None, 0, Some(&map), false, None).unwrap();
    std::fs::write(src.join("model.safetensors.index.json"), &text).unwrap();
    std::fs::write(src.join("config.json"), CONFIG).unwrap();
    let opts = bf16().convert(Tuning::default()).unwrap();
    for shard in shards {
        let mut task = ConvertTask::new(&src.join(shard), &dst.join(shard), &opts).unwrap();
        run(&mut task).unwrap();
        task.seal().unwrap();
        task.publish().unwrap();
    }
    let record = crate::record::own_index_record(&src.join(shards[0]), &dst.join(shards[0]));
    let rel = Path::new("model.safetensors.index.json");
    let scales = check::Scales::of(false, false);
    let index = check::written_index(&dst, rel, &text, &map, scales, record.unwrap().as_deref());
    std::fs::write(dst.join(rel), index.unwrap()).unwrap();
    let config = json::config_text(CONFIG, Target::Bf16, false, None).unwrap();
    std::fs::write(dst.join("config.json"), config.unwrap()).unwrap();
    (src, dst)
}

#[test]
fn a_sharded_folder_verifies_and_its_index_is_checked() {
    let (src, dst) = sharded_pair("sharded");
    let r = verify(&src, &dst, &Settings::default()).unwrap();
    assert!(r.is_ok(), "{:?}", r.mismatch);
    assert_eq!((r.files, r.parts.len()), (4, 2));
    assert_eq!(r.tensors_converted, NAMES.len());
    // An index whose total is not its shards': named, strict and loose.
    let rel = dst.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&rel).unwrap();
    let total = serde_json::from_str::<serde_json::Value>(&text).unwrap()["metadata"]["total_size"]
        .as_u64()
        .unwrap();
    let wrong = text.replacen(&total.to_string(), &(total + 2).to_string(), 1);
    std::fs::write(&rel, wrong).unwrap();
    for loose in [false, true] {
        let given = Settings {
            loose,
            ..Settings::default()
        };
        let (file, _) = verify(&src, &dst, &given).unwrap().mismatch.unwrap();
        assert_eq!(file.to_str(), Some("model.safetensors.index.json"));
    }
}

#[test]
fn a_record_convert_does_not_write_is_the_difference_not_the_pairing() {
    // Attack z11 r17: its keys in another order, the record's prefix was not stripped, and
    // the failure blamed a tensor (`is in no DST file`).
    let (src, dst) = (folder("bad-record-src"), folder("bad-record-dst"));
    f32_file(&src.join("model.safetensors"), &["module.a", "module.b"], 8);
    let given = Settings {
        strip_prefix: vec!["module.".into()],
        ..bf16()
    };
    let opts = given.convert(Tuning::default()).unwrap();
    let out = dst.join("model.safetensors");
    let mut task = ConvertTask::new(&src.join("model.safetensors"), &out, &opts).unwrap();
    run(&mut task).unwrap();
    task.seal().unwrap();
    task.publish().unwrap();
    let r = verify(&src, &dst, &Settings::default()).unwrap();
    assert!(r.is_ok(), "{:?}", r.mismatch);
    let ours = r#"{\"to\":\"bf16\",\"strip_prefix\":[\"module.\"]}"#;
    let other = r#"{\"strip_prefix\":[\"module.\"],\"to\":\"bf16\"}"#;
    let bytes = std::fs::read(&out).unwrap();
    let at = bytes.windows(ours.len()).position(|w| w == ours.as_bytes());
    let at = at.expect("the record in the header");
    let mut bytes = bytes;
    bytes[at..at + other.len()].copy_from_slice(other.as_bytes());
    std::fs::write(&out, bytes).unwrap();
    let r = verify(&src, &dst, &Settings::default()).unwrap();
    let (rel, m) = r.mismatch.expect("a difference");
    assert_eq!(rel, Path::new("model.safetensors"));
    let want = "__metadata__ entry \"stcast\" is not a record convert writes \
                (not the text convert writes): {{\"strip_prefix\":[\"module.\"],\"to\":\"bf16\"}}";
    // (A template: its braces doubled.)
    assert_eq!(m.message, want);
}
