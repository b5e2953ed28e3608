use super::*;
use crate::convert::Tuning;
use crate::given::{Given, Settings};
use crate::task::run;

/// A fresh folder for one test.
fn folder(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("stcast-rverify-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A safetensors file at `path` of F32 tensors `names`, each of `n` values (distinct ones).
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
    let header = format!("{{{}}}", entries.join(","));
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    bytes.extend(data);
    std::fs::write(path, bytes).unwrap();
}

fn settings() -> Settings {
    let bf16 = Given {
        text: Some("bf16".into()),
        whole: None,
        repr: "'bf16'".into(),
    };
    Settings {
        to: Some(bf16),
        ..Settings::default()
    }
}

fn member(root: &Path, rel: &str) -> Member {
    Member {
        rel: rel.into(),
        path: root.join(rel),
    }
}

/// Re-shard SRC's files `inputs` (one group, stem `stem`) into DST as convert does, in
/// shards of at most `max` bytes, with the index when there are several; the shards' rels.
fn reshard(src: &Path, inputs: &[&str], dst: &Path, stem: &str, max: u64) -> Vec<String> {
    let s = settings();
    let paths: Vec<PathBuf> = inputs.iter().map(|r| src.join(r)).collect();
    let group = shard::Group::open(&paths, &InputOptions::default()).unwrap();
    let plan = group.plan(max, &s.shard_plan().unwrap()).unwrap();
    let opts = s.shard_convert(Tuning::default()).unwrap();
    let n = plan.shards.len();
    let mut rels = Vec::new();
    let mut map = Vec::new();
    let mut total = 0;
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
        task.finish().unwrap();
        map.extend(names.into_iter().map(|t| (t, rel.clone())));
        total += shard.data_out;
        rels.push(rel);
    }
    if plan.indexed {
        let text = json::index(None, total, Some(&map), true, None).unwrap();
        let index = dst.join(crate::naming::index_file_name(stem));
        std::fs::write(index, text).unwrap();
    }
    rels
}

/// SRC's weights and read indexes, as verify walks them.
fn source(src: &Path, weights: &[&str], indexes: &[&str]) -> (Vec<Member>, Vec<Indexed>) {
    let weights: Vec<Member> = weights.iter().map(|r| member(src, r)).collect();
    let names: HashSet<PathBuf> = weights.iter().map(|w| w.rel.clone()).collect();
    let indexes = indexes
        .iter()
        .map(|r| {
            let f = member(src, r);
            let (_, map) = read_index(&f.path, &f.rel, false, &names, &[]).unwrap();
            (f, map)
        })
        .collect();
    (weights, indexes)
}

/// Verify every pair `pairs` finds, to its end: each group's outcome.
fn verify_all(dst: &Path, paired: &[Pair], loose: bool) -> Vec<GroupCheck> {
    let mut s = settings();
    s.loose = loose;
    let opts = s.shard_verify(Tuning::default()).unwrap();
    paired
        .iter()
        .map(|(g, d)| {
            let mut task = GroupVerify::new(dst, g, d, &InputOptions::default(), &opts).unwrap();
            run(&mut task).unwrap();
            assert_eq!(task.progress().0, task.progress().1);
            task.finish()
        })
        .collect()
}

fn found(dst: &Path) -> Vec<OsString> {
    crate::run::walk::listing(dst).unwrap()
}

const NAMES: [&str; 6] = [
    "a.weight", "b.weight", "c.weight", "d.weight", "e.bias", "f.weight",
];

#[test]
fn a_file_resharded_is_paired_by_stem_and_verifies() {
    let (src, dst) = (folder("file-src"), folder("file-dst"));
    f32_file(&src.join("model.safetensors"), &NAMES, 64);
    let rels = reshard(&src, &["model.safetensors"], &dst, "model", 600);
    assert!(rels.len() > 2, "{rels:?}");
    let (weights, indexes) = source(&src, &["model.safetensors"], &[]);
    let paired = pairs(&dst, &weights, &indexes, &found(&dst), None).unwrap();
    assert!(paired.same.is_empty());
    assert_eq!(paired.pairs.len(), 1);
    let (g, d) = &paired.pairs[0];
    assert_eq!(g.stem, "model");
    assert_eq!(d.inputs.len(), rels.len());
    assert!(d.index.is_some());
    for check in verify_all(&dst, &paired.pairs, false) {
        assert_eq!(check.failure, None);
        assert_eq!(check.reports.len(), rels.len());
        assert!(check.reports.iter().all(|(_, r)| r.is_ok()));
        let converted: usize = check.reports.iter().map(|(_, r)| r.tensors_converted).sum();
        assert_eq!(converted, NAMES.len());
    }
    // Another stem: paired under `name` only.
    let other = pairs(
        &dst,
        &weights,
        &indexes,
        &found(&dst),
        Some(OsStr::new("ema")),
    )
    .unwrap();
    assert!(other.pairs.is_empty() && other.same.is_empty());
}

#[test]
fn an_hf_folder_resharded_is_verified_by_tensor_name() {
    let (src, dst) = (folder("hf-src"), folder("hf-dst"));
    // Two shards and their index, cut after the third tensor.
    f32_file(
        &src.join("model-00001-of-00002.safetensors"),
        &NAMES[..3],
        64,
    );
    f32_file(
        &src.join("model-00002-of-00002.safetensors"),
        &NAMES[3..],
        64,
    );
    let map: Vec<(String, String)> = NAMES
        .iter()
        .enumerate()
        .map(|(i, n)| {
            (
                n.to_string(),
                format!("model-0000{}-of-00002.safetensors", 1 + i / 3),
            )
        })
        .collect();
    let text = json::index(None, 1, Some(&map), true, None).unwrap();
    std::fs::write(src.join("model.safetensors.index.json"), text).unwrap();
    let inputs = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    let (weights, indexes) = source(&src, &inputs, &["model.safetensors.index.json"]);
    // Cut otherwise: a pair.
    let rels = reshard(&src, &inputs, &dst, "model", 300);
    assert!(rels.len() > 2);
    let paired = pairs(&dst, &weights, &indexes, &found(&dst), None).unwrap();
    assert_eq!((paired.pairs.len(), paired.same.len()), (1, 0));
    let checks = verify_all(&dst, &paired.pairs, false);
    assert_eq!(checks[0].failure, None);
    // Cut where SRC was: the same files and map, still checked as a re-sharding.
    let same = folder("hf-same");
    let three = (500..1000).step_by(10).find(|&max| {
        let _ = std::fs::remove_dir_all(&same);
        std::fs::create_dir_all(&same).unwrap();
        reshard(&src, &inputs, &same, "model", max) == inputs
    });
    assert!(three.is_some());
    let paired = pairs(&same, &weights, &indexes, &found(&same), None).unwrap();
    assert_eq!((paired.pairs.len(), paired.same.len()), (0, 1));
    assert_eq!(verify_all(&same, &paired.same, false)[0].failure, None);
}

#[test]
fn a_tampered_resharding_names_the_file_and_what_is_wrong() {
    let (src, dst) = (folder("bad-src"), folder("bad-dst"));
    f32_file(&src.join("model.safetensors"), &NAMES, 64);
    let rels = reshard(&src, &["model.safetensors"], &dst, "model", 600);
    let (weights, indexes) = source(&src, &["model.safetensors"], &[]);
    let check = |loose| {
        let paired = pairs(&dst, &weights, &indexes, &found(&dst), None).unwrap();
        verify_all(&dst, &paired.pairs, loose).remove(0).failure
    };
    // A value changed in the last shard: the engine's mismatch, naming the tensor.
    let last = dst.join(rels.last().unwrap());
    let mut bytes = std::fs::read(&last).unwrap();
    let at = bytes.len() - 1;
    bytes[at] ^= 0x40;
    std::fs::write(&last, &bytes).unwrap();
    let failure = check(false).unwrap();
    assert_eq!(failure.rel, Path::new(rels.last().unwrap()));
    assert_eq!(failure.tensor.as_deref(), Some("f.weight"));
    bytes[at] ^= 0x40;
    std::fs::write(&last, &bytes).unwrap();
    assert_eq!(check(false), None);
    // The index: total size wrong (strict wants stcast's bytes; loose the total).
    let index = dst.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).unwrap();
    let edited = json::set_total_size(&text, 7).unwrap();
    std::fs::write(&index, &edited).unwrap();
    let failure = check(false).unwrap();
    assert_eq!(failure.rel, Path::new("model.safetensors.index.json"));
    assert!(failure
        .template
        .starts_with("is not the index stcast writes"));
    let failure = check(true).unwrap();
    assert!(failure
        .template
        .starts_with("its metadata.total_size is not "));
    std::fs::write(&index, &text).unwrap();
    // A tensor in two shards: named, whatever the mode.
    let first = dst.join(&rels[0]);
    let second = dst.join(&rels[1]);
    let held = std::fs::read(&second).unwrap();
    std::fs::copy(&first, &second).unwrap();
    let failure = check(true).unwrap();
    assert_eq!(failure.rel, Path::new(&rels[1]));
    assert!(failure
        .template
        .starts_with("tensor `a.weight` is also in model-00001-of-"));
    std::fs::write(&second, held).unwrap();
    assert_eq!(check(true), None);
    // A shard gone: its tensors are in no DST file (the index names a missing file).
    std::fs::remove_file(dst.join(&rels[0])).unwrap();
    let e = pairs(&dst, &weights, &indexes, &found(&dst), None)
        .err()
        .unwrap();
    assert!(
        why(&e).starts_with("names shard `model-00001-of-"),
        "{}",
        why(&e)
    );
}

#[test]
fn scales_dropped_or_added_keep_a_weight_map_the_same() {
    let m = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    };
    let plain = m(&[("x.weight", "1"), ("y.weight", "2")]);
    let scaled = m(&[
        ("x.weight", "1"),
        ("x.weight_scale", "1"),
        ("y.weight", "2"),
    ]);
    assert!(same_map(&plain, &scaled) && same_map(&scaled, &plain));
    let elsewhere = m(&[
        ("x.weight", "1"),
        ("x.weight_scale", "2"),
        ("y.weight", "2"),
    ]);
    assert!(!same_map(&plain, &elsewhere));
    let packed = m(&[
        ("x.weight_packed", "1"),
        ("x.weight_scale", "1"),
        ("y.weight", "2"),
    ]);
    assert!(same_map(&packed, &plain));
    let moved = m(&[("x.weight", "2"), ("y.weight", "2")]);
    assert!(!same_map(&plain, &moved));
    let suffixes = companion_suffixes();
    let held: HashMap<String, PathBuf> = [("x.weight".to_string(), PathBuf::from("1"))].into();
    assert!(dropped_scale("x.weight_scale", &suffixes, &held));
    assert!(dropped_scale("x.weight_packed", &suffixes, &held));
    assert!(!dropped_scale("y.weight_scale", &suffixes, &held));
    assert!(!dropped_scale("x.bias", &suffixes, &held));
}
