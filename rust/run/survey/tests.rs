use super::*;

use crate::run::json;
use crate::run::manifest::Manifest;
use crate::vocab::ErrorKind;

/// A fresh, empty folder.
fn folder(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("stcast-survey-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn bf16() -> Node<'static> {
    manifest::owned(&json::parse(r#"{"to": "bf16"}"#).unwrap())
}

/// The block a file takes room in where `dst` is written: each of the small files of
/// `outputs` takes one.
fn block(dst: &Path) -> u64 {
    let b = crate::output::block_size(&crate::output::nearest_dir(dst));
    assert!(b >= 100, "a real file system's block");
    b
}

fn planned(rel: &str, kind: Kind, size: u64) -> Planned {
    let rel = rel.into();
    Planned { rel, kind, size }
}

/// A plain run's plan: two weight files, a copy and a config, an index.
fn outputs() -> Vec<Planned> {
    vec![
        planned("model-00001-of-00002.safetensors", Kind::Weights, 100),
        planned("model-00002-of-00002.safetensors", Kind::Weights, 50),
        planned("model.safetensors.index.json", Kind::Index, 7),
        planned("tokenizer.json", Kind::Copy, 3),
        planned("config.json", Kind::Config, 2),
    ]
}

fn room() -> Room {
    let mine = outputs()
        .into_iter()
        .filter(|o| o.kind == Kind::Weights)
        .map(|o| o.rel)
        .collect();
    Room {
        mine,
        ..Room::default()
    }
}

/// The caller's answers: a proof per file (none: not adoptable), and whether entries hold.
#[derive(Default)]
struct Caller {
    proofs: HashMap<OsString, Proof>,
    asked: Vec<(OsString, Kind)>,
}

impl Judge for Caller {
    fn proof(&mut self, rel: &OsStr, kind: Kind) -> Result<Proof> {
        self.asked.push((rel.into(), kind));
        Ok(self.proofs.get(rel).cloned().unwrap_or(Proof::Known(false)))
    }

    fn done(&mut self, _: &OsStr, _: &[Node<'static>]) -> Result<bool> {
        Ok(true)
    }
}

fn ask(dst: &Path, force: bool, resume: bool, judge: &mut Caller) -> Result<Answer> {
    let options = bf16();
    let q = Question {
        asked: Asked {
            src_id: (1, 2),
            shard: None,
            options: &options,
            force,
            resume,
        },
        outputs: outputs(),
        room: Some(room()),
    };
    survey(dst, &q, judge)
}

fn put(dst: &Path, rel: &str, data: &[u8]) {
    std::fs::write(dst.join(rel), data).unwrap();
}

#[test]
fn a_new_folder_takes_the_whole_plan() {
    let dst = folder("new").join("out");
    let a = ask(&dst, false, false, &mut Caller::default()).unwrap();
    assert_eq!(a.need, 5 * block(&dst), "five files of 2 to 100 bytes");
    assert!(a.skipped.is_empty() && a.adopted.is_empty() && a.stale.is_empty());
}

#[test]
fn a_foreign_file_is_refused_unless_resume_or_force() {
    let dst = folder("foreign");
    put(&dst, "notes.txt", b"mine");
    let e = ask(&dst, false, false, &mut Caller::default()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Refused);
    assert_eq!(e.path(), Some(&*dst));
    assert_eq!(
        e.template(),
        format!(
            "{}: the destination folder holds files stcast did not write (`notes.txt`); \
             convert into an empty or new folder ({{force}} writes into it anyway, replacing \
             only what the plan writes)",
            dst.display()
        )
    );
    assert!(ask(&dst, false, true, &mut Caller::default()).is_ok());
    assert!(ask(&dst, true, false, &mut Caller::default()).is_ok());
}

#[test]
fn a_planned_file_no_manifest_proves_is_refused_naming_the_first() {
    let dst = folder("unproven");
    for rel in [
        "tokenizer.json",
        "config.json",
        "model.safetensors.index.json",
    ] {
        put(&dst, rel, b"{}");
    }
    put(&dst, "model-00001-of-00002.safetensors", &[b'x'; 100]);
    let e = ask(&dst, false, false, &mut Caller::default()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Refused);
    assert_eq!(
        e.path(),
        Some(&*dst.join("config.json")),
        "the folder's order"
    );
    let message = e.message();
    assert!(
        message.starts_with(
            "holds `config.json`, `model-00001-of-00002.safetensors`, \
             `model.safetensors.index.json` and 1 more, which this run would write"
        ),
        "{message}"
    );
    assert!(message.ends_with(
        "({resume} continues a run of this source, or takes over a finished one's exact \
         outputs; {force} replaces them)"
    ));
    // Under resume, what nothing proves the plan's is refused still, saying so.
    let mut caller = Caller::default();
    let e = ask(&dst, false, true, &mut caller).unwrap_err();
    assert!(e.message().ends_with("({force} replaces them)"));
    assert_eq!(caller.asked.len(), 4, "each asked once: {:?}", caller.asked);
}

#[test]
fn resume_adopts_exactly_what_the_plan_writes() {
    let dst = folder("adopt");
    let src = folder("adopt-src");
    put(&src, "tokenizer.json", b"tok");
    put(&dst, "tokenizer.json", b"tok");
    put(&dst, "config.json", b"{}");
    put(&dst, "model-00002-of-00002.safetensors", &[b'w'; 50]);
    let mut caller = Caller::default();
    caller.proofs.insert(
        "tokenizer.json".into(),
        Proof::SameAs(src.join("tokenizer.json")),
    );
    caller
        .proofs
        .insert("config.json".into(), Proof::Bytes(b"{}".to_vec()));
    caller.proofs.insert(
        "model-00002-of-00002.safetensors".into(),
        Proof::Known(true),
    );
    let a = ask(&dst, false, true, &mut caller).unwrap();
    let rels = |v: &[OsString]| {
        v.iter()
            .map(|r| r.to_str().unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        rels(&a.adopted),
        [
            "config.json",
            "model-00002-of-00002.safetensors",
            "tokenizer.json"
        ]
    );
    let ours: Vec<_> = a.manifests.ours.iter().map(|(r, _)| r.clone()).collect();
    assert_eq!(ours, a.adopted, "stcast's now, in the folder's order");
    // Done: the adopted weights are skipped; the rest is what the run writes.
    assert_eq!(rels(&a.skipped), ["model-00002-of-00002.safetensors"]);
    assert_eq!(a.need, 4 * block(&dst), "four files of 2 to 100 bytes");
    // Weights of another size than planned are not the plan's: the caller is not asked.
    put(&dst, "model-00002-of-00002.safetensors", &[b'w'; 49]);
    caller.asked.clear();
    let e = ask(&dst, false, true, &mut caller).unwrap_err();
    assert_eq!(
        e.path(),
        Some(&*dst.join("model-00002-of-00002.safetensors"))
    );
    assert!(!caller.asked.iter().any(|(_, kind)| *kind == Kind::Weights));
    put(&dst, "model-00002-of-00002.safetensors", &[b'w'; 50]);
    // Other bytes are not the plan's.
    put(&dst, "config.json", b"{ }");
    let e = ask(&dst, false, true, &mut caller).unwrap_err();
    assert_eq!(e.path(), Some(&*dst.join("config.json")));
    // A link is never adopted, whatever it points at.
    put(&dst, "config.json", b"{}");
    std::fs::remove_file(dst.join("tokenizer.json")).unwrap();
    std::os::unix::fs::symlink(src.join("tokenizer.json"), dst.join("tokenizer.json")).unwrap();
    let e = ask(&dst, false, true, &mut caller).unwrap_err();
    assert_eq!(e.path(), Some(&*dst.join("tokenizer.json")));
}

#[test]
fn leftovers_a_loader_would_take_for_the_output_are_refused() {
    let dst = folder("left");
    let src = folder("left-src");
    // Another cut of the same stem, and its index, beside a plan of two shards.
    put(&dst, "model-00001-of-00003.safetensors", b"");
    put(&dst, "model.safetensors", b"");
    put(&dst, "other.safetensors", b"");
    let e = ask(&dst, true, false, &mut Caller::default()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Refused);
    assert_eq!(
        e.path(),
        Some(&*dst.join("model-00001-of-00003.safetensors"))
    );
    assert_eq!(
        e.message(),
        "holds `model-00001-of-00003.safetensors`, `model.safetensors`, named as files of \
         this checkpoint's output that this run does not write; a loader would load them \
         with or instead of the new output, and no stcast manifest proves them stcast's (a \
         finished run leaves none): remove them, or convert into an empty folder"
    );
    // An index first; one file is "it".
    std::fs::remove_file(dst.join("model-00001-of-00003.safetensors")).unwrap();
    std::fs::remove_file(dst.join("model.safetensors")).unwrap();
    std::fs::create_dir(dst.join("sub")).unwrap();
    put(&dst, "sub/x.safetensors.index.json", b"{}");
    let mut q_outputs = outputs();
    q_outputs.push(planned(
        "sub/x-00001-of-00002.safetensors",
        Kind::Weights,
        1,
    ));
    let options = bf16();
    let mut room = room();
    room.renamed = vec![("".into(), "other".into())];
    let q = Question {
        asked: Asked {
            src_id: (1, 2),
            shard: None,
            options: &options,
            force: true,
            resume: false,
        },
        outputs: q_outputs,
        room: Some(room.clone()),
    };
    let e = survey(&dst, &q, &mut Caller::default()).unwrap_err();
    assert_eq!(e.path(), Some(&*dst.join("sub/x.safetensors.index.json")));
    assert!(
        e.message().starts_with(
            "holds `sub/x.safetensors.index.json`, `other.safetensors`, named as files"
        ),
        "{}",
        e.message()
    );
    // The input files themselves are not leftovers (a folder converted into itself).
    std::fs::remove_file(dst.join("sub/x.safetensors.index.json")).unwrap();
    std::fs::hard_link(dst.join("other.safetensors"), src.join("other.safetensors")).unwrap();
    let mut q = q;
    q.room = Some(Room {
        inputs: vec![src.join("other.safetensors")],
        ..room
    });
    let a = survey(&dst, &q, &mut Caller::default());
    assert!(a.is_ok(), "{a:?}");
    // One is "it".
    put(&dst, "model.safetensors", b"");
    let e = survey(&dst, &q, &mut Caller::default()).unwrap_err();
    assert_eq!(
        e.message(),
        "holds `model.safetensors`, named as a file of this checkpoint's output that this run \
         does not write; a loader would load it with or instead of the new output, and no \
         stcast manifest proves it stcast's (a finished run leaves none): remove it, or \
         convert into an empty folder"
    );
}

#[test]
fn a_destination_without_room_is_refused_for_the_whole_folder() {
    let dst = folder("room");
    let options = bf16();
    let mut outputs = outputs();
    outputs[0].size = u64::MAX / 2;
    let q = Question {
        asked: Asked {
            src_id: (1, 2),
            shard: None,
            options: &options,
            force: false,
            resume: false,
        },
        outputs,
        room: Some(room()),
    };
    let e = survey(&dst.join("a/b"), &q, &mut Caller::default()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoSpace);
    assert_eq!(e.path(), Some(&*dst), "the nearest folder there is");
    assert!(e
        .message()
        .starts_with("not enough disk space for the whole folder: need "));
    // A shard run writes its own weights only; `finalize` asks for no room.
    let q = Question {
        asked: Asked {
            shard: Some((2, 2)),
            ..q.asked
        },
        room: Some(Room {
            mine: vec!["model-00002-of-00002.safetensors".into()],
            ..Room::default()
        }),
        ..q
    };
    let need = survey(&dst, &q, &mut Caller::default()).unwrap().need;
    assert_eq!(need, block(&dst), "one file of 50 bytes");
    let q = Question { room: None, ..q };
    assert_eq!(survey(&dst, &q, &mut Caller::default()).unwrap().need, 0);
}

#[test]
fn an_output_that_is_a_file_of_the_source_is_refused_first() {
    let dst = folder("input");
    let src = folder("input-src");
    put(&src, "tokenizer.json", b"tok");
    std::fs::hard_link(src.join("tokenizer.json"), dst.join("tokenizer.json")).unwrap();
    let options = bf16();
    let q = Question {
        asked: Asked {
            src_id: (1, 2),
            shard: None,
            options: &options,
            force: true,
            resume: false,
        },
        outputs: outputs(),
        room: Some(Room {
            src: src.clone(),
            sources: vec![src.join("tokenizer.json")],
            ..room()
        }),
    };
    let e = survey(&dst, &q, &mut Caller::default()).unwrap_err();
    assert!(matches!(e, Error::Place { .. }), "{e:?}");
    assert_eq!(e.path(), Some(&*dst.join("tokenizer.json")));
}

#[test]
fn a_shard_run_leaves_another_shards_unit_to_that_run_and_finalize() {
    let dst = folder("others-unit");
    let second = "model-00002-of-00002.safetensors";
    put(&dst, second, &[b'x'; 50]);
    let options = bf16();
    let first = "model-00001-of-00002.safetensors";
    let ask = |resume: bool, caller: &mut Caller| {
        let q = Question {
            asked: Asked {
                src_id: (1, 2),
                shard: Some((1, 2)),
                options: &options,
                force: false,
                resume,
            },
            outputs: outputs(),
            room: Some(Room {
                mine: vec![first.into()],
                ..Room::default()
            }),
        };
        survey(&dst, &q, caller)
    };
    // Where no shard run of this source is, a file stcast did not write is refused, as
    // anywhere.
    let e = ask(false, &mut Caller::default()).unwrap_err();
    assert_eq!(e.path(), Some(&*dst.join(second)));
    // Beside the manifest of a run of shard 2, that run's unit is neither refused nor
    // asked about (the run replaces or refuses what is there), nor taken over: `finalize`
    // proves every unit by its shard run's manifest.
    let src = folder("others-unit-src");
    let planned = outputs().into_iter().map(|o| o.rel).collect();
    let mut sibling = Manifest::new(&src, (1, 2), &dst, bf16(), None, Some((2, 2)), planned);
    sibling.save().unwrap();
    for resume in [false, true] {
        let mut caller = Caller::default();
        let a = ask(resume, &mut caller).unwrap();
        assert!(
            caller.asked.is_empty() && a.adopted.is_empty(),
            "{:?}",
            caller.asked
        );
        assert!(a.manifests.ours.is_empty());
    }
    // Its own unit, unproven, is refused as ever.
    put(&dst, first, &[b'x'; 100]);
    let e = ask(true, &mut Caller::default()).unwrap_err();
    assert_eq!(e.path(), Some(&*dst.join(first)));
}
