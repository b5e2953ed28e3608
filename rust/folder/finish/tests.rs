use super::*;
use crate::convert::Tuning;
use crate::run::json;

/// A safetensors file of 4x4 F32 tensors named `names`.
fn f32s(names: &[&str]) -> Vec<u8> {
    crate::testutil::f32s(names, 4)
}

/// A sharded HF checkpoint (`testutil::sharded_hf`) with a tokenizer.
fn sharded(tag: &str) -> PathBuf {
    let tokenizer = ("tokenizer.json", vec![b' '; 3000]);
    crate::testutil::sharded_hf(&format!("finish-{tag}"), &[tokenizer])
}

fn bf16() -> Settings {
    Settings {
        to: Some(Given {
            text: Some("bf16".into()),
            whole: None,
            repr: "'bf16'".into(),
        }),
        ..Settings::default()
    }
}

fn options(text: &str) -> Node<'static> {
    manifest::owned(&json::parse(text).unwrap())
}

fn work(src: &Path, max_size: Option<u64>) -> Work {
    let cut = max_size.map(|max_size| Cut {
        max_size,
        ..Cut::default()
    });
    let mut task = WorkTask::new(src, &bf16(), true, false, cut, None).unwrap();
    crate::task::run(&mut task).unwrap();
    task.finish().unwrap()
}

/// Convert unit `i` of `w` to `out`, published: its report.
fn convert(w: &Work, i: usize, out: &Path) -> Report {
    let opts = w.settings(i).shard_convert(Tuning::default()).unwrap();
    let mut task = w.task(i, out, &opts).unwrap();
    crate::task::run(&mut task).unwrap();
    task.seal().unwrap();
    task.publish().unwrap()
}

/// Shard run `i` of `n` of `src` into `dst`, as `convert --shard i/n` leaves it: its units
/// written, each recorded in its manifest, saved as finished.
fn shard_run(
    src: &Path,
    dst: &Path,
    max_size: Option<u64>,
    options: &Node<'static>,
    i: u64,
    n: u64,
) {
    let w = work(src, max_size);
    let owner = w.assign_shards(n as usize);
    let mine: Vec<usize> = (0..w.units.len())
        .filter(|&k| owner[k] == i as usize)
        .collect();
    let id = place::place(src, Some(dst), Target::Bf16, true, true)
        .unwrap()
        .id;
    let planned = mine.iter().map(|&k| w.units[k].rel.clone()).collect();
    let m = Manifest::new(
        src,
        id,
        dst,
        options.clone(),
        Some(false),
        Some((i, n)),
        planned,
    );
    let mut writer = Writer::new(m, Vec::new(), Vec::new(), false);
    writer.make_folders(&[]).unwrap();
    writer.begin(HashSet::new(), false).unwrap();
    for k in mine {
        let rel = w.units[k].rel.clone();
        let out = writer.out_path(&rel).unwrap();
        convert(&w, k, &out);
        let entry = w.entry(k, options, Some(n), &out).unwrap();
        writer
            .published(&rel, "weights", None, Some(&entry))
            .unwrap();
    }
    writer.record.complete = true;
    writer.record.save().unwrap();
}

/// Step `task` to its end as a front end does, noting every (rel, done, total) it tells.
fn finalize(task: &mut FinalizeTask) -> Result<Vec<(OsString, u64, u64)>> {
    let mut told = Vec::new();
    while !task.step(1024)? {
        if let Some((rel, done, total)) = task.file_progress() {
            let now = (rel.to_os_string(), done, total);
            if told.last() != Some(&now) {
                told.push(now);
            }
        }
    }
    Ok(told)
}

fn names(dst: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dst)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

fn rows(r: &FolderReport) -> Vec<(&str, &str, &str)> {
    let rows = r.files.iter();
    rows.map(|f| (f.path.to_str().unwrap(), f.kind, f.action))
        .collect()
}

#[test]
fn finalize_completes_a_folder_after_its_shard_runs() {
    let src = sharded("plain");
    let dst = crate::testutil::folder("finish-plain-dst", &[]);
    let options = options(r#"{"to": "bf16"}"#);
    for i in 1..=2 {
        shard_run(&src, &dst, None, &options, i, 2);
    }
    let mut task = FinalizeTask::new(&src, &dst).unwrap();
    let told = finalize(&mut task).unwrap();
    // The copy told from its start to its end (a step copies a MiB).
    let copy = |done| ("tokenizer.json".into(), done, 3000);
    assert_eq!(told, [copy(0), copy(3000)]);
    assert_eq!(task.progress(), (3000, 3000));
    let r = task.finish();
    assert_eq!(
        rows(&r),
        [
            ("model-00001-of-00002.safetensors", "weights", "checked"),
            ("model-00002-of-00002.safetensors", "weights", "checked"),
            ("tokenizer.json", "copy", "copied"),
            ("config.json", "config", "rewritten"),
            ("model.safetensors.index.json", "index", "rewritten"),
        ]
    );
    // What a plain run writes, and no manifest.
    assert_eq!(
        names(&dst),
        [
            "config.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
            "tokenizer.json",
        ]
    );
    let config = std::fs::read_to_string(dst.join("config.json")).unwrap();
    assert_eq!(config, r#"{"torch_dtype": "bfloat16"}"#);
    // Nothing converted by this run: no totals, no engine.
    assert!(r.folder && r.complete && r.shard.is_none());
    assert_eq!((r.tensors_converted, r.bytes_in, r.threads), (0, 0, None));
    assert_eq!((r.max_shard_size, r.on_overflow), (None, OnOverflow::Warn));
    assert!(r.numerics.is_none() && r.warnings.is_empty());
    assert_eq!(
        r.files[0].bytes_in,
        std::fs::metadata(src.join(&r.files[0].path)).unwrap().len()
    );
    std::fs::remove_dir_all(&src).unwrap();
    std::fs::remove_dir_all(&dst).unwrap();
}

#[test]
fn finalize_of_a_re_sharding_writes_its_new_index() {
    let src = sharded("reshard");
    let dst = crate::testutil::folder("finish-reshard-dst", &[]);
    let options = options(r#"{"max_shard_size": 250, "to": "bf16"}"#);
    shard_run(&src, &dst, Some(250), &options, 1, 1);
    let mut task = FinalizeTask::new(&src, &dst).unwrap();
    finalize(&mut task).unwrap();
    let r = task.finish();
    assert_eq!(r.max_shard_size, Some(250));
    let index = r.files.iter().find(|f| f.kind == "index").unwrap();
    assert_eq!((index.action, index.bytes_in), ("written", 0));
    assert!(dst.join("model.safetensors.index.json").is_file());
    assert!(!names(&dst).iter().any(|n| n.starts_with(".stcast")));
    std::fs::remove_dir_all(&src).unwrap();
    std::fs::remove_dir_all(&dst).unwrap();
}

#[test]
fn a_unit_no_shard_run_wrote_is_refused_naming_its_shard() {
    let src = sharded("missing");
    let dst = crate::testutil::folder("finish-missing-dst", &[]);
    let options = options(r#"{"to": "bf16"}"#);
    shard_run(&src, &dst, None, &options, 1, 2);
    let mut task = FinalizeTask::new(&src, &dst).unwrap();
    let e = finalize(&mut task).unwrap_err();
    let Error::UnitMissing {
        path,
        written,
        shard,
    } = &e
    else {
        panic!("{e:?}")
    };
    // A whole file: named by its input.
    let owner = work(&src, None).assign_shards(2);
    let k = owner.iter().position(|&o| o == 2).unwrap();
    let rel = format!("model-0000{}-of-00002.safetensors", k + 1);
    assert_eq!(
        (path, *written, *shard),
        (&src.join(&rel), false, Some((2, 2)))
    );
    assert_eq!(
        e.message(),
        "not converted, or changed since; convert it again with {shard=2/2}"
    );
    assert_eq!(e.kind(), crate::vocab::ErrorKind::Refused);
    // Nothing published: no config, no index.
    assert!(!dst.join("config.json").exists());
    std::fs::remove_dir_all(&src).unwrap();
    std::fs::remove_dir_all(&dst).unwrap();
}

#[test]
fn more_shard_runs_than_units_are_refused() {
    let src = sharded("count");
    let dst = crate::testutil::folder("finish-count-dst", &[]);
    let options = options(r#"{"to": "bf16"}"#);
    shard_run(&src, &dst, None, &options, 1, 3);
    let mut task = FinalizeTask::new(&src, &dst).unwrap();
    let e = finalize(&mut task).unwrap_err();
    assert!(
        matches!(
            &e,
            Error::ShardCount {
                says: 3,
                units: 2,
                noun: "weight files",
                ..
            }
        ),
        "{e:?}"
    );
    let src_text = crate::text::esc_path(&src);
    assert_eq!(
        e.message(),
        format!("says 3 shards, but {src_text} has 2 weight files; convert the shards again")
    );
    assert_eq!(
        e.path().unwrap(),
        dst.join(manifest::file_name(Some((1, 3))))
    );
    std::fs::remove_dir_all(&src).unwrap();
    std::fs::remove_dir_all(&dst).unwrap();
}

/// A whole run's writer into `dst`, every unit of `w` converted and recorded.
fn written(w: &Work, src: &Path, dst: &Path) -> (Writer, Vec<Report>) {
    let id = place::place(src, Some(dst), Target::Bf16, true, true)
        .unwrap()
        .id;
    let planned = w.outputs().into_iter().map(|(rel, _, _)| rel).collect();
    let m = Manifest::new(
        src,
        id,
        dst,
        options(r#"{"to": "bf16"}"#),
        None,
        None,
        planned,
    );
    let mut writer = Writer::new(m, Vec::new(), Vec::new(), false);
    writer.make_folders(&[]).unwrap();
    writer.begin(HashSet::new(), false).unwrap();
    let mut reports = Vec::new();
    for (k, u) in w.units.iter().enumerate() {
        reports.push(convert(w, k, &writer.out_path(&u.rel).unwrap()));
        writer.published(&u.rel, "weights", None, None).unwrap();
    }
    (writer, reports)
}

#[test]
fn the_publish_phase_writes_the_cues_last_and_withdraws_them_on_a_failed_recheck() {
    let src = sharded("publish");
    let dst = crate::testutil::folder("finish-publish-dst", &[]);
    let w = work(&src, None);
    let (mut writer, _) = written(&w, &src, &dst);
    let mut p = Publish::new(&w);
    let mut seen = Vec::new();
    while p.stage != Stage::Recheck {
        assert!(!p.step(&w, &mut writer, 1024).unwrap());
        let there = names(&dst);
        // No config or index before the copy is complete.
        if there.contains(&"config.json".to_string()) {
            assert!(there.contains(&"tokenizer.json".to_string()));
        }
        if there.contains(&"model.safetensors.index.json".to_string()) {
            assert!(there.contains(&"config.json".to_string()));
        }
        seen.push(there.len());
    }
    assert_eq!(p.progress(), (3000, 3000));
    let done: Vec<_> = p.rows.iter().map(|r| r.path.to_str().unwrap()).collect();
    assert_eq!(
        done,
        [
            "tokenizer.json",
            "config.json",
            "model.safetensors.index.json"
        ]
    );
    // A weight file replaced since it was written: the final re-check fails, and the
    // loader's cues go again (the copy stays).
    let shard = dst.join(&w.units[0].rel);
    std::fs::remove_file(&shard).unwrap();
    std::fs::write(&shard, f32s(&["a", "b"])).unwrap();
    let e = p.step(&w, &mut writer, 1024).unwrap_err();
    assert_eq!(e.kind(), crate::vocab::ErrorKind::Refused, "{e:?}");
    let there = names(&dst);
    assert!(!there.contains(&"config.json".to_string()), "{there:?}");
    assert!(!there.contains(&"model.safetensors.index.json".to_string()));
    assert!(there.contains(&"tokenizer.json".to_string()));
    std::fs::remove_dir_all(&src).unwrap();
    std::fs::remove_dir_all(&dst).unwrap();
}

#[test]
fn a_failed_recheck_before_the_cues_writes_none() {
    let src = sharded("early");
    let dst = crate::testutil::folder("finish-early-dst", &[]);
    let w = work(&src, None);
    let (mut writer, _) = written(&w, &src, &dst);
    let shard = dst.join(&w.units[1].rel);
    std::fs::remove_file(&shard).unwrap();
    std::fs::write(&shard, f32s(&["c", "d"])).unwrap();
    let mut p = Publish::new(&w);
    let e = loop {
        match p.step(&w, &mut writer, u64::MAX) {
            Ok(done) => assert!(!done),
            Err(e) => break e,
        }
    };
    assert_eq!(e.kind(), crate::vocab::ErrorKind::Refused, "{e:?}");
    assert_eq!(p.rows.len(), 1); // the copy
    assert!(!dst.join("config.json").exists());
    assert!(!dst.join("model.safetensors.index.json").exists());
    std::fs::remove_dir_all(&src).unwrap();
    std::fs::remove_dir_all(&dst).unwrap();
}

#[test]
fn a_folder_report_adds_up_its_units_and_names_their_files() {
    let src = sharded("report");
    let dst = crate::testutil::folder("finish-report-dst", &[]);
    let w = work(&src, None);
    let (_, reports) = written(&w, &src, &dst);
    let warning = Warning {
        kind: crate::vocab::WarningKind::NothingToConvert,
        text: "said".into(),
    };
    let converted: Vec<Converted> = (reports.into_iter().enumerate())
        .map(|(k, mut report)| {
            report.unquantized = vec![format!("m{}", 1 - k), "shared".into()];
            report.kept = vec![KeptTensor {
                name: format!("t{k}"),
                dtype: safetensors::Dtype::F32,
                bytes: 64,
                reason: crate::plan::Reason::KeptByPattern("t*".into()),
            }];
            Converted {
                rel: w.units[k].rel.clone(),
                report,
                warnings: vec![(warning.clone(), Some(w.units[k].rel.clone()))],
                measured: true,
            }
        })
        .collect();
    let files = (0..2)
        .map(|k| FileRow::converted(&w, k, &converted[k]))
        .collect();
    let said = Said {
        src: src.clone(),
        dst: dst.clone(),
        to: Target::Bf16,
        started: Instant::now(),
        shard: Some((1, 2)),
        complete: false,
        on_overflow: OnOverflow::Keep,
        max_shard_size: None,
        first: vec![(warning.clone(), None)],
    };
    let r = FolderReport::new(said, files, &converted);
    let of = |f: fn(&Report) -> usize| converted.iter().map(|c| f(&c.report)).sum::<usize>();
    assert_eq!(r.tensors_converted, of(|r| r.tensors_converted));
    assert_eq!(r.tensors_converted, 4);
    let bytes_out: u64 = converted.iter().map(|c| c.report.bytes_out).sum();
    assert_eq!(r.bytes_out, bytes_out);
    assert_eq!(r.threads, Some(converted[1].report.threads));
    assert_eq!((r.shard.clone(), r.complete), (Some(vec![1, 2]), false));
    assert_eq!(r.unquantized, ["m0", "m1", "shared"]);
    // Each kept tensor names its unit's file, first.
    let kept = serde_json::to_string(&r.kept).unwrap();
    let rel = w.units[1].rel.to_str().unwrap();
    let second = format!(r#"{{"file":"{rel}","name":"t1","dtype":"F32","bytes":64"#);
    assert!(kept.contains(&second), "{kept}");
    // The run's own warnings first, then each unit's.
    let at: Vec<_> = r.warnings.iter().map(|(_, at)| at.clone()).collect();
    assert_eq!(
        at,
        [
            None,
            Some(w.units[0].rel.clone()),
            Some(w.units[1].rel.clone())
        ]
    );
    let mut total = Numerics::default();
    converted
        .iter()
        .for_each(|c| total.merge(&c.report.numerics_total));
    assert_eq!(r.numerics, Some(total));
    assert_eq!(r.files[1].action, "converted");
    assert_eq!(r.files[1].tensors_converted, 2);
    // One unit not measured: no numerics for the folder.
    let mut converted = converted;
    converted[0].measured = false;
    let said = Said {
        src,
        dst: dst.clone(),
        to: Target::Bf16,
        started: Instant::now(),
        shard: None,
        complete: true,
        on_overflow: OnOverflow::Warn,
        max_shard_size: None,
        first: Vec::new(),
    };
    assert!(FolderReport::new(said, Vec::new(), &converted)
        .numerics
        .is_none());
    std::fs::remove_dir_all(&dst).unwrap();
}
