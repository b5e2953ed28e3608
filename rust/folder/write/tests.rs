//! Folder runs through the engine's own API, no Python: an HF folder, a DCP and a ZeRO
//! checkpoint converted, re-sharded, stopped and resumed, split into shard runs and
//! finalized, each output verified as `verify` does.

use std::path::{Path, PathBuf};

use super::*;
use crate::folder::finish::FinalizeTask;
use crate::folder::prepare::{Asked, PrepareTask};
use crate::folder::verify_folder::FolderVerify;
use crate::given::ShardGiven;
use crate::run::manifest;
use crate::task;
use crate::testutil::fixture;
use crate::testutil::{text as given, whole};

/// A fresh folder holding `files` (relative path, bytes).
fn folder(tag: &str, files: &[(&str, Vec<u8>)]) -> PathBuf {
    crate::testutil::folder_of(&format!("write-{tag}"), files)
}

/// Two weight files under an index, a lone one, a config and a readme.
fn hf(tag: &str) -> PathBuf {
    let f32s = |names: &[&str]| crate::testutil::f32s(names, 4);
    let index = r#"{"metadata": {"total_size": 192}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}}"#;
    folder(
        tag,
        &[
            ("model-00001-of-00002.safetensors", f32s(&["a", "b"])),
            ("model-00002-of-00002.safetensors", f32s(&["c"])),
            ("model.safetensors.index.json", index.into()),
            ("extra/lone.safetensors", f32s(&["x"])),
            ("config.json", br#"{"torch_dtype": "float32"}"#.to_vec()),
            ("README.md", b"hello".to_vec()),
        ],
    )
}

fn asked(src: &Path, dst: &Path, key: Option<&str>, max_size: Option<u64>) -> Asked {
    Asked {
        src: src.to_path_buf(),
        dst: Some(dst.to_path_buf()),
        settings: Settings {
            to: Some(given("bf16")),
            key: key.map(str::to_string),
            max_shard_size: max_size.map(whole),
            ..Settings::default()
        },
    }
}

fn prepared(asked: Asked) -> Result<Prepared> {
    let mut t = PrepareTask::new(asked)?;
    task::run(&mut t)?;
    t.finish()
}

/// Prepare and write `asked`, stopping (dropping the run) once `stop_after` units are
/// converted, if given.
fn run(asked: Asked, stop_after: Option<usize>) -> Result<Option<FolderReport>> {
    let mut w = ConvertFolderTask::new(prepared(asked)?, None, Tuning::default());
    loop {
        if stop_after.is_some_and(|n| w.converted.len() >= n) {
            return Ok(None);
        }
        match w.step(u64::MAX) {
            Ok(true) => return Ok(Some(w.finish().0)),
            Ok(false) => {}
            Err(e) => return Err(w.failed(e)),
        }
    }
}

/// Whether `dst` verifies as what convert makes of `src` (`key`: how it is read).
fn verifies(src: &Path, dst: &Path, key: Option<&str>) -> bool {
    let s = Settings {
        key: key.map(str::to_string),
        ..Settings::default()
    };
    let mut v = FolderVerify::new(src, dst, &s, Tuning::default()).unwrap();
    task::run(&mut v).unwrap();
    let r = v.finish().unwrap();
    assert!(r.mismatch.is_none(), "{:?}", r.mismatch);
    r.is_ok()
}

/// The names in `dst` (recursively, relative), sorted.
fn listing(dst: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut todo = vec![dst.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            match p.is_dir() {
                true => todo.push(p),
                false => out.push(p.strip_prefix(dst).unwrap().to_string_lossy().into_owned()),
            }
        }
    }
    out.sort();
    out
}

fn actions(r: &FolderReport) -> Vec<(String, &'static str)> {
    let rows = r.files.iter();
    rows.map(|f| (f.path.to_string_lossy().into_owned(), f.action))
        .collect()
}

/// Convert `src` into a fresh DST (re-sharded at `max_size`), stopped after its first unit
/// and resumed, then verified, and converted again under resume (every unit done).
fn stopped_resumed_verified(src: &Path, key: Option<&str>, max_size: Option<u64>) -> FolderReport {
    let dst = src.with_extension("out");
    let _ = std::fs::remove_dir_all(&dst);
    assert!(run(asked(src, &dst, key, max_size), Some(1))
        .unwrap()
        .is_none());
    // Stopped: the manifest says what is done, no index or config is there yet.
    let there = listing(&dst);
    assert!(there.contains(&manifest::file_name(None)), "{there:?}");
    assert!(!there
        .iter()
        .any(|f| f.ends_with(".json") && !f.contains("stcast")));
    // Without resume, the stopped run's folder is refused; resumed, it goes on.
    let e = run(asked(src, &dst, key, max_size), None).err().unwrap();
    assert_eq!(
        e.kind(),
        crate::vocab::ErrorKind::Refused,
        "{}",
        e.template()
    );
    let mut a = asked(src, &dst, key, max_size);
    a.settings.resume = true;
    let r = run(a.clone(), None).unwrap().unwrap();
    let skipped = r.files.iter().filter(|f| f.action == "skipped").count();
    let converted = r.files.iter().filter(|f| f.action == "converted").count();
    assert_eq!(skipped, 1, "{:?}", actions(&r));
    assert!(r.complete && r.folder);
    // Done: no stcast file stays behind, and DST is exactly SRC converted.
    assert!(!listing(&dst).iter().any(|f| f.contains("stcast")));
    assert!(verifies(src, &dst, key));
    // Again under resume: every unit is done.
    let again = run(a, None).unwrap().unwrap();
    let weights = again.files.iter().filter(|f| f.kind == "weights");
    assert!(weights.clone().all(|f| f.action == "skipped"));
    assert_eq!(weights.count(), skipped + converted);
    assert!(verifies(src, &dst, key));
    r
}

#[test]
fn an_hf_folder_is_converted_stopped_resumed_and_verified() {
    let src = hf("hf");
    let r = stopped_resumed_verified(&src, None, None);
    let got = actions(&r);
    let want = [
        ("extra/lone.safetensors", "skipped"),
        ("model-00001-of-00002.safetensors", "converted"),
        ("model-00002-of-00002.safetensors", "converted"),
        ("README.md", "copied"),
        ("config.json", "rewritten"),
        ("model.safetensors.index.json", "rewritten"),
    ];
    let want: Vec<(String, &str)> = want.iter().map(|(p, a)| (p.to_string(), *a)).collect();
    assert_eq!(got, want);
    assert_eq!(r.tensors_converted, 3);
}

#[test]
fn an_hf_folder_is_resharded_and_verified() {
    let src = hf("hf-reshard");
    let r = stopped_resumed_verified(&src, None, Some(200));
    assert_eq!(r.max_shard_size, Some(200));
    let shards = r.files.iter().filter(|f| f.kind == "weights").count();
    assert_eq!(shards, 4);
}

#[test]
fn shard_runs_then_finalize_make_the_whole_folder() {
    let src = hf("hf-shards");
    let dst = src.with_extension("out");
    let _ = std::fs::remove_dir_all(&dst);
    for i in 1..=2 {
        let mut a = asked(&src, &dst, None, None);
        a.settings.shard = Some(ShardGiven {
            parts: Some((i, 2)),
            numbers: format!("{i}/2"),
            repr: format!("({i}, 2)"),
        });
        let r = run(a, None).unwrap().unwrap();
        assert_eq!(r.shard, Some(vec![i as u64, 2]));
        assert!(!r.complete);
        // A shard run writes its units only: no copy, config or index.
        assert!(r.files.iter().all(|f| f.kind == "weights"));
    }
    let mut f = FinalizeTask::new(&src, &dst).unwrap();
    task::run(&mut f).unwrap();
    let r = f.finish();
    assert!(r.complete);
    assert!(!listing(&dst).iter().any(|f| f.contains("stcast")));
    assert!(verifies(&src, &dst, None));
}

#[test]
fn a_dcp_checkpoint_is_resharded_stopped_resumed_and_verified() {
    let files = [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"];
    let src = fixture("write-dcp", "dcp/fsdp2-1d-3ranks", &files);
    let r = stopped_resumed_verified(&src, Some("model"), Some(400));
    assert!(r.files.iter().filter(|f| f.kind == "weights").count() > 1);
    assert!(r.files.iter().any(|f| f.kind == "index"));
}

#[test]
fn a_zero_checkpoint_is_resharded_stopped_resumed_and_verified() {
    let src = fixture(
        "write-zero",
        "zero/stage2-3ranks",
        &["latest", "global_step1/"],
    );
    let r = stopped_resumed_verified(&src, None, Some(400));
    assert!(r.files.iter().filter(|f| f.kind == "weights").count() > 1);
}

#[test]
fn a_whole_run_checks_its_report_path_first_and_writes_the_report_last() {
    use crate::folder::run::RunTask;
    let src = hf("run-report");
    let dst = src.with_extension("out");
    let report = src.with_extension("report.json");
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::write(&report, b"someone else's").unwrap();
    let s = Settings {
        report: Some(report.clone()),
        ..Settings::default()
    };
    // An existing report without force: refused before DST is made.
    let mut t = RunTask::new(&src, Some(&dst), &s, Tuning::default()).unwrap();
    let e = task::run(&mut t).unwrap_err();
    assert_eq!(e.kind(), crate::vocab::ErrorKind::DestinationExists);
    assert!(!dst.exists());
    std::fs::remove_file(&report).unwrap();
    let mut t = RunTask::new(&src, Some(&dst), &s, Tuning::default()).unwrap();
    task::run(&mut t).unwrap();
    let (r, converted) = t.finish().unwrap();
    assert_eq!((r.tensors_converted, converted.len()), (4, 3));
    let text = std::fs::read_to_string(&report).unwrap();
    assert!(text.contains("model-00002-of-00002.safetensors"), "{text}");
    assert!(verifies(&src, &dst, None));
}

#[test]
fn a_report_failing_after_a_folder_runs_commit_is_a_refusal_about_the_folder() {
    // As `_api._after_commit` made it: refused, about the folder, the failure's template.
    let e = Error::AfterCommit {
        published: "/d/out".into(),
        source: Box::new(Error::DestinationExists {
            path: "/d/r.json".into(),
        }),
        folder: true,
    };
    assert_eq!(e.kind(), crate::vocab::ErrorKind::Refused);
    assert_eq!(e.path(), Some(Path::new("/d/out")));
    assert_eq!(e.errno(), None);
    let t = e.template();
    assert!(
        t.starts_with("/d/out was published, but then /d/r.json: destination exists"),
        "{t}"
    );
}
