use super::*;
use crate::given::Given;
use crate::testutil::fixture;
use crate::testutil::{text as given, whole};
use crate::vocab::ErrorKind;

/// A fresh folder holding `files` (relative path, bytes).
fn folder(tag: &str, files: &[(&str, Vec<u8>)]) -> PathBuf {
    crate::testutil::folder_of(&format!("prepare-{tag}"), files)
}

/// A safetensors file of 4x4 F32 tensors named `names`.
fn f32s(names: &[&str]) -> Vec<u8> {
    crate::testutil::f32s(names, 4)
}

/// Two weight files and a config.
fn plain(tag: &str) -> PathBuf {
    folder(
        tag,
        &[
            ("a.safetensors", f32s(&["a", "b"])),
            ("b.safetensors", f32s(&["c"])),
            ("config.json", br#"{"torch_dtype": "float32"}"#.to_vec()),
            ("README.md", b"hello".to_vec()),
        ],
    )
}

fn asked(src: &Path, dst: &Path) -> Asked {
    Asked {
        src: src.to_path_buf(),
        dst: Some(dst.to_path_buf()),
        settings: Settings {
            to: Some(given("bf16")),
            ..Settings::default()
        },
    }
}

fn shard(i: i128, n: i128) -> Option<ShardGiven> {
    Some(ShardGiven {
        parts: Some((i, n)),
        numbers: format!("{i}/{n}"),
        repr: format!("({i}, {n})"),
    })
}

/// Prepare `asked` to its end; the warnings said on the way, and the run.
fn prepare(asked: Asked) -> Result<(Vec<Said>, Prepared)> {
    let mut task = PrepareTask::new(asked)?;
    let mut said = Vec::new();
    while !task.step(u64::MAX)? {
        said.extend(task.take_said());
    }
    said.extend(task.take_said());
    Ok((said, task.finish()?))
}

fn rels(p: &Prepared, units: &[usize]) -> Vec<String> {
    let rel = |&k: &usize| p.work.units[k].rel.to_string_lossy().into_owned();
    units.iter().map(rel).collect()
}

/// The run's options as a manifest records them.
fn options(p: &Prepared) -> Vec<(String, String)> {
    let Value::Object(members) = &p.options.value else {
        panic!("not an object");
    };
    let shown = |v: &Node<'_>| match &v.value {
        Value::Str(Str::Text(t)) => t.to_string(),
        Value::Number(n) => n.to_string(),
        Value::Literal(l) => l.to_string(),
        Value::Array(items) => format!("[{}]", items.len()),
        v => format!("{v:?}"),
    };
    let key = |k: &Str<'_>| match k {
        Str::Text(t) => t.to_string(),
        Str::Wide(_) => "?".into(),
    };
    members.iter().map(|(k, v)| (key(k), shown(v))).collect()
}

#[test]
fn a_plain_run_into_a_new_folder_writes_every_unit() {
    let src = plain("new");
    let dst = src.with_extension("out");
    let _ = std::fs::remove_dir_all(&dst);
    let (said, p) = prepare(asked(&src, &dst)).unwrap();
    assert!(said.is_empty(), "{said:?}");
    assert_eq!(
        (p.src.as_path(), p.dst.as_path()),
        (src.as_path(), dst.as_path())
    );
    assert_eq!(p.target, Target::Bf16);
    assert_eq!(rels(&p, &p.todo), ["a.safetensors", "b.safetensors"]);
    assert!(p.skipped.is_empty());
    assert_eq!(p.units, p.todo);
    // Every file the run writes, sorted; the copies.
    let mine: Vec<_> = p.mine.iter().map(|m| m.to_str().unwrap()).collect();
    assert_eq!(
        mine,
        ["README.md", "a.safetensors", "b.safetensors", "config.json"]
    );
    assert_eq!(p.copies.len(), 1);
    assert_eq!(options(&p), [("to".into(), "bf16".into())]);
}

#[test]
fn the_options_a_manifest_records_leave_out_the_defaults() {
    let src = plain("options");
    let dst = src.with_extension("out");
    let _ = std::fs::remove_dir_all(&dst);
    let mut a = asked(&src, &dst);
    a.settings.keep = vec!["a".into()];
    a.settings.on_overflow = Some(given("keep"));
    a.settings.strip_prefix = vec!["model.".into()];
    a.settings.from_bf16 = true;
    a.settings.keep_min_size = Some(Given {
        text: None,
        whole: Some(0),
        repr: "0".into(),
    });
    let (_, p) = prepare(a).unwrap();
    let got = options(&p);
    let want = [
        ("to", "bf16"),
        ("keep", "[1]"),
        ("from_bf16", "true"),
        ("on_overflow", "keep"),
        ("strip_prefix", "[1]"),
    ];
    let want: Vec<(String, String)> = want
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    assert_eq!(got, want);
}

#[test]
fn a_resharding_records_its_size_and_name() {
    let src = plain("reshard");
    let dst = src.with_extension("out");
    let _ = std::fs::remove_dir_all(&dst);
    let mut a = asked(&src, &dst);
    a.settings.max_shard_size = Some(whole(1 << 20));
    let (_, p) = prepare(a).unwrap();
    assert_eq!(p.work.noun(), "output shards");
    let got = options(&p);
    assert_eq!(
        got.last().unwrap(),
        &("max_shard_size".into(), "1048576".into())
    );
}

#[test]
fn a_shard_run_writes_its_share_and_copies_nothing() {
    let src = plain("shard");
    let dst = src.with_extension("out");
    let _ = std::fs::remove_dir_all(&dst);
    let (mut one, mut two) = (asked(&src, &dst), asked(&src, &dst));
    (one.settings.shard, two.settings.shard) = (shard(1, 2), shard(2, 2));
    let (_, p1) = prepare(one).unwrap();
    let (_, p2) = prepare(two).unwrap();
    assert_eq!((p1.shard, p2.shard), (Some((1, 2)), Some((2, 2))));
    let (r1, r2) = (rels(&p1, &p1.units), rels(&p2, &p2.units));
    assert_eq!((r1.len(), r2.len()), (1, 1));
    assert_ne!(r1, r2);
    let mine: Vec<_> = p1
        .mine
        .iter()
        .map(|m| m.to_string_lossy().into_owned())
        .collect();
    assert_eq!(mine, r1);
    assert!(p1.copies.is_empty() && p2.copies.is_empty());
}

#[test]
fn a_shard_range_is_refused_before_anything_else_is_read() {
    let src = plain("range");
    let dst = src.with_extension("out");
    let mut a = asked(&src, &dst);
    a.settings.shard = shard(1, 3);
    let e = prepare(a).err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Usage);
    assert_eq!(e.option(), Some(OptionName::Shard));
    assert_eq!(
        e.template(),
        "{shard}: '1/3' is not I/N with N at most 2, the number of weight files"
    );
    for (parts, repr) in [
        (Some((0, 2)), "(0, 2)"),
        (Some((3, 2)), "(3, 2)"),
        (None, "'x'"),
    ] {
        let mut a = asked(&src, &dst);
        a.settings.shard = Some(ShardGiven {
            parts,
            numbers: String::new(),
            repr: repr.into(),
        });
        let e = prepare(a).err().unwrap();
        assert_eq!(
            e.template(),
            format!("{{shard}}: {repr} is not a pair (i, n) of whole numbers with 1 <= i <= n")
        );
    }
}

#[test]
fn a_keep_pattern_that_matches_nothing_is_said_once_or_refused_under_strict() {
    let src = plain("unmatched");
    let dst = src.with_extension("out");
    let _ = std::fs::remove_dir_all(&dst);
    let mut a = asked(&src, &dst);
    a.settings.keep = vec!["zz*".into(), "a".into()];
    let (said, _) = prepare(a.clone()).unwrap();
    assert_eq!(said.len(), 1);
    assert_eq!(said[0].0.kind, WarningKind::UnmatchedPattern);
    assert_eq!(said[0].0.text, unmatched_message(&["zz*".into()]));
    assert_eq!(
        said[0].0.text,
        "{keep} pattern `zz*` matches no tensor name (a typo?)"
    );
    a.settings.strict = true;
    let e = prepare(a).err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Refused);
    assert!(e.template().ends_with(
        ": {keep} pattern `zz*` matches no tensor name (a typo?); nothing was written \
         ({strict} makes this an error)"
    ));
}

#[test]
fn a_folder_of_other_files_is_refused_unless_forced() {
    let src = plain("survey");
    let dst = src.with_extension("out");
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    std::fs::write(dst.join("other.txt"), b"x").unwrap();
    let e = prepare(asked(&src, &dst)).err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Refused);
    assert!(e
        .template()
        .contains("holds files stcast did not write (`other.txt`)"));
    // Forced, the run replaces what it writes and says nothing of the rest.
    let mut a = asked(&src, &dst);
    a.settings.force = true;
    let (_, p) = prepare(a).unwrap();
    assert_eq!(p.todo.len(), 2);
    assert_eq!(p.survey.manifests.found.len(), 1);
}

#[test]
fn a_file_left_out_that_dst_holds_is_said() {
    let src = folder(
        "leftout",
        &[
            ("a.safetensors", f32s(&["a"])),
            ("optimizer.pt", b"state".to_vec()),
        ],
    );
    let dst = src.with_extension("out");
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    std::fs::write(dst.join("optimizer.pt"), b"state").unwrap();
    let mut a = asked(&src, &dst);
    a.settings.force = true;
    let (said, _) = prepare(a).unwrap();
    let kinds: Vec<_> = said.iter().map(|(w, _)| w.kind).collect();
    assert_eq!(
        kinds,
        [WarningKind::SkippedFiles, WarningKind::SkippedFiles]
    );
    assert!(said[1]
        .0
        .text
        .starts_with("DST holds `optimizer.pt`, which this run leaves out"));
}

/// A safetensors file of one 4x4 F32 tensor `w` whose first value is `x`.
fn holding(x: f32) -> Vec<u8> {
    let mut bytes = f32s(&["w"]);
    let at = bytes.len() - 64;
    bytes[at..at + 4].copy_from_slice(&x.to_le_bytes());
    bytes
}

#[test]
fn overflow_refused_over_an_earlier_output_is_read_for_first() {
    let src = folder(
        "overflow",
        &[
            ("a.safetensors", holding(1.0)),
            ("b.safetensors", holding(1e6)),
        ],
    );
    let dst = src.with_extension("out");
    let _ = std::fs::remove_dir_all(&dst);
    let mut a = asked(&src, &dst);
    a.settings.to = Some(given("fp16"));
    a.settings.on_overflow = Some(given("error"));
    // Into a new folder: nothing is replaced, converting refuses it in time.
    prepare(a.clone()).unwrap();
    // Over an earlier output: refused before anything is replaced.
    std::fs::create_dir_all(&dst).unwrap();
    std::fs::write(dst.join("a.safetensors"), b"old").unwrap();
    a.settings.force = true;
    let e = prepare(a).err().unwrap();
    assert!(matches!(e, Error::Overflow { .. }), "{}", e.template());
    assert!(e.template().contains("b.safetensors"), "{}", e.template());
}

/// Write the units of `p` still to do as a run converts them (each its own conversion,
/// published under its name), with no manifest.
fn convert(p: &Prepared) {
    for &i in &p.todo {
        let opts = p.work.settings(i).shard_convert(Tuning::default()).unwrap();
        let out = p.dst.join(&p.work.units[i].rel);
        std::fs::create_dir_all(out.parent().unwrap()).unwrap();
        let mut task = p.work.task(i, &out, &opts).unwrap();
        crate::task::run(&mut task).unwrap();
        task.seal().unwrap();
        task.publish().unwrap();
    }
}

/// Prepare `src` into a fresh `dst` (re-sharded at `max_size`), convert every unit, check
/// each is exactly what the plan writes (every value verified against the inputs), then
/// prepare again under resume: every unit is taken over as done, nothing is left to do.
fn converted_verified_resumed(src: &Path, key: Option<&str>, max_size: Option<u64>) -> usize {
    let dst = src.with_extension("out");
    let _ = std::fs::remove_dir_all(&dst);
    let mut a = asked(src, &dst);
    (a.settings.max_shard_size, a.settings.key) = (max_size.map(whole), key.map(str::to_string));
    let (_, p) = prepare(a.clone()).unwrap();
    assert_eq!(p.todo.len(), p.work.units.len());
    convert(&p);
    for &i in &p.units {
        let out = p.dst.join(&p.work.units[i].rel);
        assert!(
            p.work.adoptable(i, &out, Tuning::default()).unwrap(),
            "{out:?}"
        );
    }
    a.settings.resume = true;
    let (_, again) = prepare(a.clone()).unwrap();
    assert!(again.todo.is_empty());
    assert_eq!(again.skipped, again.units);
    assert_eq!(again.survey.adopted.len(), p.work.units.len());
    // A unit changed since is not what the plan writes: resume refuses to replace it.
    let first = p.dst.join(&p.work.units[0].rel);
    let mut bytes = std::fs::read(&first).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&first, bytes).unwrap();
    assert!(!p.work.adoptable(0, &first, Tuning::default()).unwrap());
    let e = prepare(a).err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Refused, "{}", e.template());
    p.work.units.len()
}

#[test]
fn an_hf_folder_is_converted_verified_and_resumed() {
    assert_eq!(converted_verified_resumed(&plain("hf-run"), None, None), 2);
    // Re-sharded: each file a group of its own, cut into shards of at most 200 bytes (one
    // tensor each).
    let src = plain("hf-reshard");
    assert_eq!(converted_verified_resumed(&src, None, Some(200)), 3);
}

#[test]
fn a_dcp_checkpoint_is_resharded_verified_and_resumed() {
    let files = [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"];
    let src = fixture("prepare-dcp", "dcp/fsdp2-1d-3ranks", &files);
    let model = Some("model");
    assert_eq!(converted_verified_resumed(&src, model, Some(1 << 30)), 1);
    assert!(converted_verified_resumed(&src, model, Some(400)) > 1);
}

#[test]
fn a_zero_checkpoint_is_resharded_verified_and_resumed() {
    let src = fixture(
        "prepare-zero",
        "zero/stage2-3ranks",
        &["latest", "global_step1/"],
    );
    assert_eq!(converted_verified_resumed(&src, None, Some(1 << 30)), 1);
    assert!(converted_verified_resumed(&src, None, Some(400)) > 1);
}

#[test]
fn what_was_said_before_a_refusal_is_told_first() {
    let src = plain("said-first");
    let dst = src.with_extension("out");
    let _ = std::fs::remove_dir_all(&dst);
    let mut a = asked(&src, &dst);
    // Nothing changes (the output would be a copy of the folder), and a keep pattern
    // matches nothing: said first, then refused.
    (a.settings.to, a.settings.keep) = (Some(given("keep")), vec!["zz".into()]);
    let mut task = PrepareTask::new(a).unwrap();
    let mut said = Vec::new();
    let e = loop {
        said.extend(task.take_said());
        match task.step(u64::MAX) {
            Ok(true) => panic!("not refused"),
            Ok(false) => {}
            Err(e) => break e,
        }
    };
    assert!(
        matches!(e, Error::FolderUnchanged { .. }),
        "{}",
        e.template()
    );
    let kinds: Vec<_> = said.iter().map(|(w, _)| w.kind).collect();
    assert_eq!(kinds, [WarningKind::UnmatchedPattern]);
}
