use super::*;
use crate::run::json::Value;

/// A fresh folder holding `files` (relative path, bytes).
fn folder(tag: &str, files: &[(&str, Vec<u8>)]) -> PathBuf {
    crate::testutil::folder_of(&format!("work-{tag}"), files)
}

/// A safetensors file of 4x4 F32 tensors named `names`.
fn f32s(names: &[&str]) -> Vec<u8> {
    crate::testutil::f32s(names, 4)
}

fn settings(to: &str) -> Settings {
    Settings {
        to: Some(Given {
            text: Some(to.into()),
            whole: None,
            repr: format!("'{to}'"),
        }),
        // (No record in the outputs' metadata: the shards' sizes are the tensors'.)
        no_record: true,
        ..Settings::default()
    }
}

fn work(src: &Path, s: &Settings, single: bool, max_size: Option<u64>) -> Result<Work> {
    let cut = max_size.map(|max_size| Cut {
        max_size,
        ..Cut::default()
    });
    let mut task = WorkTask::new(src, s, true, single, cut, None)?;
    crate::task::run(&mut task)?;
    task.finish()
}

fn rels(w: &Work) -> Vec<&str> {
    w.units.iter().map(|u| u.rel.to_str().unwrap()).collect()
}

/// A sharded HF checkpoint (`testutil::sharded_hf`).
fn sharded(tag: &str) -> PathBuf {
    crate::testutil::sharded_hf(&format!("work-{tag}"), &[])
}

#[test]
fn a_plain_folder_is_one_unit_per_weight_file() {
    let src = sharded("plain");
    let w = work(&src, &settings("bf16"), false, None).unwrap();
    assert_eq!(w.max_size, None);
    assert_eq!(w.noun(), "weight files");
    assert_eq!(
        rels(&w),
        [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors"
        ]
    );
    for (k, u) in w.units.iter().enumerate() {
        assert!(u.whole);
        assert_eq!((u.group, u.inputs.as_slice()), (k, &[k][..]));
        assert_eq!(u.data_bytes, 128);
        assert_eq!(u.target_bytes, 64);
        assert_eq!(u.input_bytes, w.plan.weights[k].size);
        assert_eq!(u.tensors_converted, 2);
    }
    // Weights first, then the config, then the source's index (edited, so a little larger).
    let outputs = w.outputs();
    let got: Vec<(&str, Kind)> = (outputs.iter())
        .map(|(r, k, _)| (r.to_str().unwrap(), *k))
        .collect();
    assert_eq!(
        got,
        [
            ("model-00001-of-00002.safetensors", Kind::Weights),
            ("model-00002-of-00002.safetensors", Kind::Weights),
            ("config.json", Kind::Config),
            ("model.safetensors.index.json", Kind::Index),
        ]
    );
    assert_eq!(
        w.outputs()[3].2,
        crate::testutil::SHARDED_INDEX.len() as u64 + 64
    );
    std::fs::remove_dir_all(&src).unwrap();
}

#[test]
fn a_sharded_folder_is_re_sharded_into_new_shards_and_an_index() {
    let src = sharded("reshard");
    // Each output shard holds at most two BF16 tensors (32 bytes each) with its header.
    let w = work(&src, &settings("bf16"), false, Some(250)).unwrap();
    assert_eq!(w.noun(), "output shards");
    let names: Vec<&[String]> = w.units.iter().map(|u| u.names.as_slice()).collect();
    let all: Vec<&str> = names
        .iter()
        .flat_map(|n| n.iter().map(String::as_str))
        .collect();
    assert_eq!(all, ["a", "b", "c", "d"]);
    let n = w.units.len();
    assert!(n > 1, "{:?}", rels(&w));
    for (i, u) in w.units.iter().enumerate() {
        assert_eq!(u.rel, shard_name(OsStr::new("model"), i + 1, n));
        assert!(u.size <= 250 && !u.whole);
    }
    // The first shard stands for the group's headers too: the shards add up to the files.
    let input: u64 = w.units.iter().map(|u| u.input_bytes).sum();
    assert_eq!(input, w.plan.weights.iter().map(|f| f.size).sum::<u64>());
    let (rel, text, map) = w.groups[0].index.as_ref().unwrap();
    assert_eq!(rel, "model.safetensors.index.json");
    assert_eq!(map.len(), 4);
    let doc = json::parse(text).unwrap();
    let total = doc
        .get("metadata")
        .and_then(|m| m.get("total_size"))
        .unwrap();
    assert!(matches!(&total.value, Value::Number(t) if t == "128"));
    // The index is new: its size is its text's.
    let index = w
        .outputs()
        .into_iter()
        .find(|o| o.1 == Kind::Index)
        .unwrap();
    assert_eq!(index.2, text.len() as u64);
    std::fs::remove_dir_all(&src).unwrap();
}

#[test]
fn name_renames_one_group_and_refuses_several() {
    let src = sharded("named");
    let mut s = settings("bf16");
    s.name = Some("ema".into());
    let w = work(&src, &s, false, Some(250)).unwrap();
    assert!(rels(&w).iter().all(|r| r.starts_with("ema-0000")));
    let renamed = w.groups[0].renamed.clone().unwrap();
    assert_eq!(renamed, ("".into(), "model".into()));
    std::fs::write(src.join("extra.safetensors"), f32s(&["e"])).unwrap();
    let e = work(&src, &s, false, Some(250)).err().unwrap();
    assert!(matches!(e, Error::NamedMany { count: 2, .. }), "{e:?}");
    std::fs::remove_dir_all(&src).unwrap();
}

#[test]
fn a_lone_file_is_a_folder_of_one_group() {
    let src = folder("lone", &[("ema.safetensors", f32s(&["a", "b"]))]);
    let path = src.join("ema.safetensors");
    let w = work(&path, &settings("bf16"), true, Some(1 << 20)).unwrap();
    assert_eq!(rels(&w), ["ema.safetensors"]);
    assert!(w.groups[0].index.is_none() && !w.units[0].whole);
    assert_eq!(w.hashes, [fingerprint(&path).unwrap()]);
    // Cut in two: shards named after its stem, and an index.
    let w = work(&path, &settings("bf16"), true, Some(150)).unwrap();
    assert_eq!(
        rels(&w),
        [
            "ema-00001-of-00002.safetensors",
            "ema-00002-of-00002.safetensors"
        ]
    );
    assert!(w.groups[0].index.is_some());
    std::fs::remove_dir_all(&src).unwrap();
}

/// Convert unit `i` of `w` into `dst`, published.
fn convert(w: &Work, i: usize, dst: &Path) {
    let opts = w
        .settings(i)
        .shard_convert(Tuning::new(&Default::default()).unwrap());
    let mut task = w.task(i, dst, &opts.unwrap()).unwrap();
    crate::task::run(&mut task).unwrap();
    task.seal().unwrap();
    task.publish().unwrap();
}

#[test]
fn a_unit_is_matched_by_its_entry_and_adopted_by_its_values() {
    let src = sharded("entries");
    let w = work(&src, &settings("bf16"), false, Some(250)).unwrap();
    let dst = crate::testutil::folder("work-entries-dst", &[]);
    let out = dst.join(&w.units[0].rel);
    convert(&w, 0, &out);
    let tuning = || Tuning::new(&Default::default()).unwrap();
    assert!(w.adoptable(0, &out, tuning()).unwrap());
    // Another unit's planned header: not this one.
    assert!(!w.adoptable(1, &out, tuning()).unwrap());
    let options = json::parse(r#"{"to": "bf16", "max_shard_size": 250}"#).unwrap();
    let options = manifest::owned(&options);
    let entry = w.entry(0, &options, None, &out).unwrap();
    let entries = vec![entry];
    assert!(w.find_entry(0, &entries, &options, &out).unwrap().is_some());
    // Other options, or another unit: no entry shows it.
    let other = manifest::owned(&json::parse(r#"{"to": "fp16"}"#).unwrap());
    assert!(w.find_entry(0, &entries, &other, &out).unwrap().is_none());
    assert!(w.find_entry(1, &entries, &options, &out).unwrap().is_none());
    // The file changed since: its header is not the one recorded.
    std::fs::write(&out, f32s(&["x"])).unwrap();
    assert!(w.find_entry(0, &entries, &options, &out).unwrap().is_none());
    std::fs::remove_dir_all(&src).unwrap();
    std::fs::remove_dir_all(&dst).unwrap();
}

#[test]
fn a_whole_file_is_matched_by_the_header_recorded() {
    let src = sharded("whole-entries");
    let w = work(&src, &settings("bf16"), false, None).unwrap();
    let dst = crate::testutil::folder("work-whole-dst", &[]);
    let out = dst.join(&w.units[1].rel);
    convert(&w, 1, &out);
    let options = manifest::owned(&json::parse(r#"{"to": "bf16"}"#).unwrap());
    let entry = w.entry(1, &options, Some(2), &out).unwrap();
    // One input: named flat, as plain runs' entries always were.
    assert!(entry.get("source_size").is_some() && entry.get("inputs").is_none());
    assert!(w.find_entry(1, &[entry], &options, &out).unwrap().is_some());
    std::fs::remove_dir_all(&src).unwrap();
    std::fs::remove_dir_all(&dst).unwrap();
}

#[test]
fn two_outputs_of_one_name_are_refused() {
    // The index's group cut into one shard is `model.safetensors`, which the lone file
    // beside it is too.
    let src = sharded("clash");
    std::fs::write(src.join("model.safetensors"), f32s(&["e"])).unwrap();
    let e = work(&src, &settings("bf16"), false, Some(1 << 20))
        .err()
        .unwrap();
    assert!(matches!(e, Error::OutputsCollide { .. }), "{e:?}");
    assert!(
        e.message().contains("would be written there"),
        "{}",
        e.message()
    );
    std::fs::remove_dir_all(&src).unwrap();
}

#[test]
fn the_survey_asks_the_plan_for_its_proofs() {
    use crate::run::survey::Judge;
    let src = sharded("judged");
    std::fs::write(src.join("tokenizer.json"), b"{}").unwrap();
    let w = work(&src, &settings("bf16"), false, None).unwrap();
    let dst = crate::testutil::folder("work-judged-dst", &[]);
    let options = manifest::owned(&json::parse(r#"{"to": "bf16"}"#).unwrap());
    let mut judge = Judged {
        work: &w,
        dst: &dst,
        options: &options,
    };
    let proof = |j: &mut Judged<'_>, rel: &str, kind| j.proof(OsStr::new(rel), kind).unwrap();
    // A copy is its source file; a config, its new text.
    let copy = proof(&mut judge, "tokenizer.json", Kind::Copy);
    assert!(matches!(copy, Proof::SameAs(p) if p == src.join("tokenizer.json")));
    let config = proof(&mut judge, "config.json", Kind::Config);
    assert!(matches!(config, Proof::Bytes(b) if b == br#"{"torch_dtype": "bfloat16"}"#));
    // A weights file is adopted when it is exactly the plan's output.
    let rel = w.units[0].rel.to_str().unwrap().to_string();
    convert(&w, 0, &dst.join(&rel));
    let weights = proof(&mut judge, &rel, Kind::Weights);
    assert!(matches!(weights, Proof::Known(true)));
    // The edited index: the source's, with the total size the plan gives.
    let index = proof(&mut judge, "model.safetensors.index.json", Kind::Index);
    let Proof::Bytes(index) = index else {
        panic!("{index:?}")
    };
    assert!(String::from_utf8(index)
        .unwrap()
        .contains(r#""total_size": 128"#));
    // Done: by an entry made for it.
    let entry = w.entry(0, &options, None, &dst.join(&rel)).unwrap();
    assert!(judge.done(OsStr::new(&rel), &[entry]).unwrap());
    std::fs::remove_dir_all(&src).unwrap();
    std::fs::remove_dir_all(&dst).unwrap();
}

#[test]
fn shard_runs_split_the_units_by_size() {
    let w = |units: &[(String, u64)]| Work {
        units: (units.iter().enumerate())
            .map(|(i, (rel, size))| Unit {
                rel: rel.into(),
                group: i,
                names: Vec::new(),
                size: *size,
                data_bytes: 0,
                input_bytes: 0,
                target_bytes: 0,
                header_sha256: String::new(),
                inputs: Vec::new(),
                tensors_converted: 0,
                tensors_kept: 0,
                whole: true,
            })
            .collect(),
        plan: FolderPlan::default(),
        max_size: None,
        groups: Vec::new(),
        warnings: Vec::new(),
        hashes: Vec::new(),
        record: None,
        settings: Settings::default(),
        recorded: None,
    };
    let sizes = [9, 1, 5, 5, 3, 7, 2];
    let units: Vec<(String, u64)> = (sizes.iter().enumerate())
        .map(|(i, &s)| (format!("f{i}"), s))
        .collect();
    let a = w(&units).assign_shards(3);
    let load = |k| (0..7).filter(|&i| a[i] == k).map(|i| sizes[i]).sum::<u64>();
    let mut loads: Vec<u64> = (1..=3).map(load).collect();
    loads.sort();
    assert_eq!(loads, [10, 11, 11]);
    // Largest first, ties by name: the order the units come in does not matter.
    let reversed: Vec<(String, u64)> = units.iter().rev().cloned().collect();
    let mut b = w(&reversed).assign_shards(3);
    b.reverse();
    assert_eq!(a, b);
    // As many runs as units: one each.
    let mut each = w(&units).assign_shards(10);
    each.sort();
    assert_eq!(each, (1..=7).collect::<Vec<_>>());
}

#[test]
fn a_plain_run_that_changes_nothing_is_refused_a_re_sharding_is_not() {
    let src = sharded("unchanged");
    let w = work(&src, &settings("keep"), false, None).unwrap();
    let e = w.check(&src).err().unwrap();
    assert!(matches!(e, Error::FolderUnchanged { .. }), "{e:?}");
    assert!(e
        .message()
        .ends_with("the output would be a copy of the folder"));
    assert!(work(&src, &settings("bf16"), false, None)
        .unwrap()
        .check(&src)
        .is_ok());
    let w = work(&src, &settings("keep"), false, Some(1 << 20)).unwrap();
    assert!(w.check(&src).is_ok());
    std::fs::remove_dir_all(&src).unwrap();
}
