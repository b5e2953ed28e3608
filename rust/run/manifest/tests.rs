use super::*;

/// A fresh, empty folder.
fn folder(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("stcast-manifest-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn parsed(text: &str) -> Node<'static> {
    owned(&json::parse(text).unwrap())
}

fn bf16() -> Node<'static> {
    parsed(r#"{"to": "bf16"}"#)
}

fn record(dst: &Path, shard: Option<Shard>) -> Manifest {
    let planned = vec![OsString::from("a.safetensors")];
    Manifest::new(
        Path::new("/nonexistent/src"),
        (1, 2),
        dst,
        bf16(),
        None,
        shard,
        planned,
    )
}

fn problem(e: Error) -> ManifestProblem {
    match e {
        Error::Manifest { problem, .. } => problem,
        e => panic!("{e:?}"),
    }
}

fn id_of(path: &Path) -> (u64, u64, u64) {
    let m = std::fs::symlink_metadata(path).unwrap();
    (m.dev(), m.ino(), m.size())
}

#[test]
fn the_text_is_what_python_json_dumps_writes() {
    let name = OsStr::from_bytes(b"/nonexistent/src\xff");
    let options = parsed(r#"{"to": "bf16", "keep": ["a*", "\u00e9"]}"#);
    let planned = vec![
        OsString::from("a.safetensors"),
        OsString::from_vec(b"caf\xe9".to_vec()),
    ];
    let mut m = Manifest::new(
        Path::new(name),
        (1, 2),
        Path::new("/x"),
        options,
        None,
        Some((1, 2)),
        planned,
    );
    m.token = "ab".repeat(16);
    let extra = parsed(r#"{"shards": null}"#);
    m.record(
        OsStr::new("a.safetensors"),
        "weights",
        (3, 4, 5),
        Some(&extra),
    );
    m.claim(OsStr::new("b"), (6, 7, 8), "");
    let want = "{\n \"format\": 2,\n \"version\": \"VERSION\",\n \"src\": \"/nonexistent/src\\udcff\",\n \"src_id\": [\n  1,\n  2\n ],\n \"options\": {\n  \"to\": \"bf16\",\n  \"keep\": [\n   \"a*\",\n   \"\\u00e9\"\n  ]\n },\n \"allow_quantized\": null,\n \"shard\": [\n  1,\n  2\n ],\n \"planned\": [\n  \"a.safetensors\",\n  \"caf\\udce9\"\n ],\n \"complete\": false,\n \"files\": {\n  \"a.safetensors\": {\n   \"kind\": \"weights\",\n   \"dev\": 3,\n   \"ino\": 4,\n   \"size\": 5,\n   \"shards\": null\n  }\n },\n \"pending\": {\n  \"b\": [\n   {\n    \"dev\": 6,\n    \"ino\": 7,\n    \"size\": 8,\n    \"output_header_sha256\": \"\"\n   }\n  ]\n },\n \"finalize\": false,\n \"run\": \"abababababababababababababababab\"\n}\n";
    assert_eq!(m.text(), want.replace("VERSION", VERSION));
}

#[test]
fn names_of_manifests() {
    assert_eq!(file_name(None), ".stcast-manifest.json");
    assert_eq!(
        file_name(Some((2, 3))),
        ".stcast-manifest.shard-2-of-3.json"
    );
    for yes in [
        ".stcast-manifest.json",
        ".stcast-manifest.shard-1-of-2.json",
    ] {
        assert!(is_manifest(yes.as_bytes()), "{yes}");
    }
    for no in [
        ".stcast-manifest.shard--of-2.json",
        ".stcast-manifest.shard-1-of-x.json",
        "a.json",
    ] {
        assert!(!is_manifest(no.as_bytes()), "{no}");
    }
}

#[test]
fn a_saved_manifest_loads_back_and_proves_its_files() {
    let dst = folder("roundtrip");
    let mut m = record(&dst, Some((1, 2)));
    std::fs::write(dst.join("a.safetensors"), b"x").unwrap();
    std::fs::write(dst.join("b"), b"yy").unwrap();
    std::fs::write(dst.join("c"), b"z").unwrap();
    let name = OsString::from_vec(b"n\xff".to_vec());
    std::fs::write(dst.join(&name), b"w").unwrap();
    m.record(
        OsStr::new("a.safetensors"),
        "weights",
        id_of(&dst.join("a.safetensors")),
        None,
    );
    m.claim(OsStr::new("b"), id_of(&dst.join("b")), "");
    m.claim(&name, id_of(&dst.join(&name)), "");
    m.save().unwrap();
    m.check_still_ours().unwrap();
    m.recheck().unwrap();
    let (found, bad) = load_all(&dst).unwrap();
    assert!(bad.is_empty(), "{bad:?}");
    let [back] = found.as_slice() else {
        panic!("{found:?}")
    };
    assert_eq!(
        (back.shard, back.src_id, &back.planned),
        (Some((1, 2)), (1, 2), &m.planned)
    );
    assert_eq!((&back.files, &back.pending), (&m.files, &m.pending));
    assert_eq!(
        back.text().replace(&back.token, ""),
        m.text().replace(&m.token, "")
    );
    for (rel, ours) in [
        ("a.safetensors", true),
        ("b", true),
        ("c", false),
        ("d", false),
    ] {
        assert_eq!(
            proves(&found, &dst, OsStr::new(rel)).unwrap().is_some(),
            ours,
            "{rel}"
        );
    }
    assert!(proves(&found, &dst, &name).unwrap().is_some());
    // A claim names the size: a file of another size there is not the one claimed.
    std::fs::write(dst.join("b"), b"yyy").unwrap();
    assert!(proves(&found, &dst, OsStr::new("b")).unwrap().is_none());
    m.remove().unwrap();
    assert!(load_all(&dst).unwrap().0.is_empty());
}

#[test]
fn a_run_whose_manifest_another_run_replaced_stops() {
    let dst = folder("taken");
    let mut m = record(&dst, None);
    m.save().unwrap();
    let mut rival = record(&dst, None);
    rival.first_replace = m.published;
    rival.save().unwrap();
    assert!(matches!(
        problem(m.check_still_ours().unwrap_err()),
        ManifestProblem::TakenOver { .. }
    ));
    assert!(matches!(
        problem(m.save().unwrap_err()),
        ManifestProblem::TakenOver { .. }
    ));
    // Removing it leaves the rival's.
    m.remove().unwrap();
    assert!(dst.join(MANIFEST).exists());
    // A first save does not replace another run's manifest.
    let mut late = record(&dst, None);
    assert!(matches!(
        late.save().unwrap_err(),
        Error::DestinationExists { .. }
    ));
}

#[test]
fn a_file_changed_during_the_run_fails_the_recheck_and_roll_back_keeps_what_was_there() {
    let dst = folder("recheck");
    let mut m = record(&dst, None);
    for f in ["a", "b"] {
        std::fs::write(dst.join(f), f).unwrap();
        m.record(OsStr::new(f), "copy", id_of(&dst.join(f)), None);
    }
    m.save().unwrap();
    m.recheck().unwrap();
    std::fs::write(dst.join("b"), b"bigger").unwrap();
    assert_eq!(problem(m.recheck().unwrap_err()), ManifestProblem::Changed);
    let before: HashSet<OsString> = [OsString::from("b")].into();
    assert_eq!(m.roll_back(&before, false), vec![OsString::from("a")]);
    assert!(!dst.join("a").exists() && dst.join("b").exists() && !dst.join(MANIFEST).exists());
}

#[test]
fn tampered_manifests_are_unreadable_with_a_reason() {
    let dst = folder("tampered");
    let good = record(&dst, Some((1, 2))).text();
    let cases = [
        ("{\"format\": 2,".to_string(), "cannot be read"),
        ("[".repeat(100) + &"]".repeat(100), "not a stcast manifest"),
        (
            good.replace("\"format\": 2", "\"format\": 3"),
            "manifest format 3",
        ),
        (
            good.replace("\"format\": 2", "\"format\": \"2\""),
            "manifest format \"2\"",
        ),
        (good.replace("\"src_id\"", "\"src_idx\""), "no 'src_id'"),
        (
            good.replace("\"to\": \"bf16\"", "\"to\": \"int4\""),
            "wrong type",
        ),
        (
            good.replace("\"files\": {}", "\"files\": [1]"),
            "wrong type",
        ),
        (
            good.replace("\"planned\": [\n  \"a.safetensors\"", "\"planned\": [\n  1"),
            "wrong type",
        ),
        (
            good.replace("\"shard\": [\n  1,", "\"shard\": [\n  3,"),
            "wrong type",
        ),
        ("\u{e9}".into(), "not ASCII"),
    ];
    for (text, reason) in cases {
        std::fs::write(dst.join(file_name(Some((1, 2)))), &text).unwrap();
        let (found, bad) = load_all(&dst).unwrap();
        assert!(found.is_empty(), "{text}");
        assert!(bad[0].reason.contains(reason), "{reason}: {:?}", bad[0]);
    }
}

#[test]
fn the_survey_refuses_what_it_cannot_prove_and_finds_what_it_can() {
    let dst = folder("survey");
    let options = bf16();
    let asked = |shard, force, resume| Asked {
        src_id: (1, 2),
        shard,
        options: &options,
        force,
        resume,
    };
    let mut one = record(&dst, Some((1, 2)));
    std::fs::write(dst.join("a.safetensors"), b"x").unwrap();
    one.record(
        OsStr::new("a.safetensors"),
        "weights",
        id_of(&dst.join("a.safetensors")),
        None,
    );
    one.save().unwrap();
    // Shard 2 of the same source and options shares the folder.
    let s = survey(&dst, &asked(Some((2, 2)), false, false)).unwrap();
    assert_eq!(s.ours.len(), 1);
    assert_eq!((s.siblings.len(), s.own.is_none()), (1, true));
    assert_eq!(s.entries[0].1.len(), 1);
    // Shard 1 again, a whole run: refused.
    let again = survey(&dst, &asked(Some((1, 2)), false, false)).unwrap_err();
    assert!(matches!(
        problem(again),
        ManifestProblem::Stopped { shard: true, .. }
    ));
    assert_eq!(
        problem(survey(&dst, &asked(None, false, false)).unwrap_err()),
        ManifestProblem::ShardRuns
    );
    let s = survey(&dst, &asked(Some((1, 2)), false, true)).unwrap();
    assert!(s.own.is_some() && s.siblings.is_empty());
    // Other options, another source.
    let fp16 = parsed(r#"{"to": "fp16"}"#);
    let other = Asked {
        options: &fp16,
        ..asked(Some((2, 2)), false, false)
    };
    assert_eq!(
        problem(survey(&dst, &other).unwrap_err()),
        ManifestProblem::OtherOptions
    );
    let stranger = Asked {
        src_id: (9, 9),
        ..asked(Some((2, 2)), false, false)
    };
    assert!(matches!(
        problem(survey(&dst, &stranger).unwrap_err()),
        ManifestProblem::OtherSource { .. }
    ));
    let s = survey(
        &dst,
        &Asked {
            force: true,
            ..stranger
        },
    )
    .unwrap();
    assert!(s.ours.is_empty() && s.found.len() == 1);
}

#[test]
fn finalize_completes_finished_runs_that_agree() {
    let dst = folder("finalize");
    assert_eq!(
        problem(finished(&dst.join("none"), (1, 2)).unwrap_err()),
        ManifestProblem::NoFolder
    );
    assert_eq!(
        problem(finished(&dst, (1, 2)).unwrap_err()),
        ManifestProblem::NothingToFinalize
    );
    let mut one = record(&dst, Some((1, 2)));
    one.options = parsed(r#"{"to": "bf16", "max_shard_size": 10}"#);
    one.save().unwrap();
    let unfinished = problem(finished(&dst, (1, 2)).unwrap_err());
    assert_eq!(
        unfinished,
        ManifestProblem::Unfinished {
            shard: Some((1, 2))
        }
    );
    one.complete = true;
    one.save().unwrap();
    let done = finished(&dst, (1, 2)).unwrap();
    // The options as `json.dumps(sort_keys=True)` leaves them.
    assert_eq!(
        Dump::indented(None).text(&done.options),
        r#"{"max_shard_size": 10, "to": "bf16"}"#
    );
    let mut two = record(&dst, Some((2, 2)));
    two.complete = true;
    two.save().unwrap();
    assert!(matches!(
        problem(finished(&dst, (1, 2)).unwrap_err()),
        ManifestProblem::Disagree { .. }
    ));
    for (options, bad) in [
        (r#"{"to": "bf16", "max_shard_size": 0}"#, "size"),
        (r#"{"to": "bf16", "name": "a/b"}"#, "name"),
    ] {
        let mut m = record(&dst, Some((1, 2)));
        m.options = parsed(options);
        let refusal = problem(agreed_options(&dst, &[m]).unwrap_err());
        match bad {
            "size" => assert!(matches!(refusal, ManifestProblem::BadSize { .. })),
            _ => assert!(matches!(refusal, ManifestProblem::BadName { .. })),
        }
    }
}

#[test]
fn entries_record_the_file_there_now() {
    let dst = folder("recording");
    let path = dst.join("a.safetensors");
    std::fs::write(&path, b"x").unwrap();
    let mut one = record(&dst, None);
    one.record(OsStr::new("a.safetensors"), "weights", id_of(&path), None);
    one.complete = true;
    one.save().unwrap();
    let entries = || finished(&dst, (1, 2)).unwrap().entries;
    let counts = |e: Vec<(OsString, Vec<Node<'static>>)>| {
        e.into_iter()
            .map(|(rel, list)| (rel, list.len()))
            .collect::<Vec<_>>()
    };
    assert_eq!(counts(entries()), [("a.safetensors".into(), 1)]);
    // Rewritten in place (the same inode) to another size: not the file recorded.
    std::fs::write(&path, b"xy").unwrap();
    assert_eq!(counts(entries()), [("a.safetensors".into(), 0)]);
    // Gone, or no regular file: none either.
    std::fs::remove_file(&path).unwrap();
    assert_eq!(counts(entries()), [("a.safetensors".into(), 0)]);
    std::fs::create_dir(&path).unwrap();
    assert_eq!(counts(entries()), [("a.safetensors".into(), 0)]);
}
