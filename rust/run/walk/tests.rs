use std::os::unix::fs::symlink;

use super::*;
use crate::vocab::ErrorKind;

fn folder(tag: &str, files: &[&str]) -> PathBuf {
    crate::testutil::folder(&format!("walk-{tag}"), files)
}

fn rels(files: &[File]) -> Vec<&str> {
    files.iter().map(|f| f.rel.to_str().unwrap()).collect()
}

fn problem(e: &Error) -> &WalkProblem {
    match e {
        Error::Walk { problem, .. } => problem,
        _ => panic!("{e:?}"),
    }
}

#[test]
fn files_are_classified_sorted_and_bookkeeping_left_out() {
    let dir = folder(
        "classify",
        &[
            "model-00002-of-00002.safetensors",
            "model-00001-of-00002.safetensors",
            "model.safetensors.index.json",
            "config.json",
            "tokenizer.json",
            ".stcast-manifest.json",
            ".git/lfs/objects/blob",
            ".cache/huggingface/download/model.safetensors.metadata",
            "text_encoder/config.json",
            "text_encoder/model.safetensors",
            "text_encoder/.cache/kept.txt",
            "text_encoder/.git/HEAD",
            "optimizer.pt",
            "rng_state_3.pth",
            "training_args.bin",
        ],
    );
    let w = walk(&dir, false, &Overrides::default()).unwrap();
    assert_eq!(
        rels(&w.weights),
        [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "text_encoder/model.safetensors"
        ]
    );
    assert_eq!(rels(&w.indexes), ["model.safetensors.index.json"]);
    assert_eq!(
        rels(&w.configs),
        ["config.json", "text_encoder/config.json"]
    );
    assert_eq!(
        rels(&w.others),
        ["text_encoder/.cache/kept.txt", "tokenizer.json"]
    );
    assert_eq!(w.dirs, ["text_encoder", "text_encoder/.cache"]);
    let skipped: Vec<_> = w
        .skipped
        .iter()
        .map(|(f, why)| (f.rel.to_str().unwrap(), *why))
        .collect();
    assert_eq!(
        skipped,
        [
            ("optimizer.pt", TRAINER),
            ("rng_state_3.pth", TRAINER),
            ("training_args.bin", TRAINER)
        ]
    );
    let f = &w.weights[2];
    assert_eq!(f.path, dir.join("text_encoder/model.safetensors"));
    assert_eq!(f.size, "text_encoder/model.safetensors".len() as u64);
    let meta = std::fs::metadata(&f.path).unwrap();
    assert_eq!(f.mtime_ns, meta.mtime() * 1_000_000_000 + meta.mtime_nsec());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn training_state_is_left_out_by_name_files_and_folders() {
    // An accelerate checkpoint (FSDP), with DeepSpeed's ZeRO state beside the HF weights.
    let dir = folder(
        "training",
        &[
            "model.safetensors",
            "config.json",
            "optimizer.bin",
            "optimizer_1.bin",
            "scheduler.bin",
            "scaler.pt",
            "random_states_0.pkl",
            "pytorch_model_fsdp.bin",
            "pytorch_model_fsdp_1.bin",
            "trainer_state.json",
            "zero_to_fp32.py",
            "latest",
            "global_step7/mp_rank_00_model_states.pt",
            "global_step7/zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "optimizer_0/__0_0.distcp",
            "pytorch_model_fsdp_0/.metadata",
            "scheduler/scheduler_config.json",
            "scheduler_config.json",
            "latest_notes.txt",
        ],
    );
    std::fs::write(dir.join("latest"), "global_step7\n").unwrap();
    let w = walk(&dir, false, &Overrides::default()).unwrap();
    let skipped: Vec<_> = w
        .skipped
        .iter()
        .map(|(f, why)| (f.rel.to_str().unwrap(), f.size, *why))
        .collect();
    let size = |rels: &[&str]| rels.iter().map(|r| r.len() as u64).sum::<u64>();
    assert_eq!(
        skipped,
        [
            (
                "global_step7/",
                size(&[
                    "global_step7/mp_rank_00_model_states.pt",
                    "global_step7/zero_pp_rank_0_mp_rank_00_optim_states.pt"
                ]),
                TRAINER
            ),
            ("latest", 13, TRAINER),
            ("optimizer.bin", 13, TRAINER),
            ("optimizer_0/", size(&["optimizer_0/__0_0.distcp"]), TRAINER),
            ("optimizer_1.bin", 15, TRAINER),
            // Sorted by its name in the source.
            (
                "model.safetensors",
                size(&["pytorch_model_fsdp.bin"]),
                TRAINER
            ),
            (
                "pytorch_model_fsdp_0/",
                size(&["pytorch_model_fsdp_0/.metadata"]),
                TRAINER
            ),
            ("pytorch_model_fsdp_1.bin", 24, TRAINER),
            ("random_states_0.pkl", 19, TRAINER),
            ("scaler.pt", 9, TRAINER),
            ("scheduler.bin", 13, TRAINER),
            ("trainer_state.json", 18, TRAINER),
            ("zero_to_fp32.py", 15, TRAINER),
        ]
    );
    assert_eq!(w.skipped[5].0.source_rel(), "pytorch_model_fsdp.bin");
    // A diffusers scheduler's config, and names that only look alike, are copied.
    assert_eq!(rels(&w.weights), ["model.safetensors"]);
    assert_eq!(
        rels(&w.others),
        [
            "latest_notes.txt",
            "scheduler/scheduler_config.json",
            "scheduler_config.json"
        ]
    );
    // Without other weights beside it, accelerate's whole FSDP state dict is the model.
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let w = walk(&dir, false, &Overrides::default()).unwrap();
    assert_eq!(rels(&w.weights), ["model.safetensors"]);
    assert_eq!(w.weights[0].source_rel(), "pytorch_model_fsdp.bin");
    // `latest` naming no folder beside it is an ordinary file.
    std::fs::write(dir.join("latest"), "global_step8").unwrap();
    let w = walk(&dir, false, &Overrides::default()).unwrap();
    assert!(rels(&w.others).contains(&"latest"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn latest_naming_a_folder_of_weights_leaves_nothing_out() {
    // `latest` naming a folder without DeepSpeed's states (`ema/`, weights): both are walked
    // as any other (attack z10 r5: `ema/` was left out unread, its weights missing).
    let dir = folder(
        "latest-ema",
        &[
            "model.safetensors",
            "config.json",
            "latest",
            "ema/model.safetensors",
            "ema/config.json",
        ],
    );
    std::fs::write(dir.join("latest"), "ema\n").unwrap();
    let w = walk(&dir, false, &Overrides::default()).unwrap();
    assert!(w.skipped.is_empty(), "{:?}", w.skipped);
    assert_eq!(
        rels(&w.weights),
        ["ema/model.safetensors", "model.safetensors"]
    );
    assert_eq!(rels(&w.configs), ["config.json", "ema/config.json"]);
    assert_eq!(rels(&w.others), ["latest"]);
    // Once it holds DeepSpeed's states, it is a tag folder: training state, with `latest`.
    std::fs::write(dir.join("ema/mp_rank_00_model_states.pt"), "").unwrap();
    let w = walk(&dir, false, &Overrides::default()).unwrap();
    let skipped: Vec<_> = w
        .skipped
        .iter()
        .map(|(f, _)| f.rel.to_str().unwrap())
        .collect();
    assert_eq!(skipped, ["ema/", "latest"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn include_and_exclude_override_what_is_copied() {
    let dir = folder(
        "overrides",
        &[
            "model.safetensors",
            "model.safetensors.index.json",
            "config.json",
            "tokenizer.json",
            "README.md",
            "images/a.png",
            "images/b/c.png",
            "optimizer.bin",
            "scaler.pt",
            "pytorch_model.bin",
            "global_step7/mp_rank_00_model_states.pt",
            "global_step7/optimizer.pt",
            "latest",
        ],
    );
    std::fs::write(dir.join("latest"), "global_step7").unwrap();
    let globs = |g: &[&str]| g.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let o = Overrides::new(
        &globs(&["optimizer*", "global_step*", "pytorch_model.bin"]),
        &globs(&[
            "images",
            "*.md",
            "config.json",
            "*.safetensors*",
            "scaler.pt",
        ]),
    )
    .unwrap();
    let w = walk(&dir, false, &o).unwrap();
    // Weights and indexes are never excluded; the folder of training state comes whole
    // (its files as any folder's), the PyTorch weights as they are named.
    assert_eq!(rels(&w.weights), ["model.safetensors"]);
    assert_eq!(rels(&w.indexes), ["model.safetensors.index.json"]);
    assert!(w.configs.is_empty());
    assert_eq!(
        rels(&w.others),
        [
            "global_step7/mp_rank_00_model_states.pt",
            "global_step7/optimizer.pt",
            "optimizer.bin",
            "pytorch_model.bin",
            "tokenizer.json"
        ]
    );
    assert_eq!(w.dirs, [OsString::from("global_step7")]);
    let skipped: Vec<_> = w
        .skipped
        .iter()
        .map(|(f, why)| (f.rel.to_str().unwrap(), *why))
        .collect();
    assert_eq!(
        skipped,
        [
            ("README.md", EXCLUDED),
            ("config.json", EXCLUDED),
            ("images/a.png", EXCLUDED),
            ("images/b/c.png", EXCLUDED),
            ("latest", TRAINER),
            ("scaler.pt", TRAINER),
        ]
    );
    // Every glob matched a file (or a folder of training state, or one left out).
    assert!(w.warnings.is_empty(), "{:?}", w.warnings);
    // A folder kept where a file in it is not excluded; a bad glob names its option.
    let o = Overrides::new(&globs(&["*.nope"]), &globs(&["images/b*", "x/"])).unwrap();
    let w = walk(&dir, false, &o).unwrap();
    assert_eq!(w.dirs, [OsString::from("images")]);
    // A glob that matches no file is one warning each, naming it and its option.
    let said: Vec<_> = w
        .warnings
        .iter()
        .map(|w| (w.kind, w.text.as_str()))
        .collect();
    assert_eq!(
        said,
        [
            (
                crate::vocab::WarningKind::UnmatchedPattern,
                "{include} glob `*.nope` matches no file of the folder (a typo?)"
            ),
            (
                crate::vocab::WarningKind::UnmatchedPattern,
                "{exclude} glob `x/` matches no file of the folder (a typo?)"
            ),
        ]
    );
    let e = Overrides::new(&[], &globs(&["a["])).unwrap_err();
    assert!(matches!(
        e,
        Error::BadPattern {
            option: OptionName::Exclude,
            ..
        }
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn pytorch_files_are_renamed_or_superseded() {
    let dir = folder(
        "torch",
        &[
            "pytorch_model-00001-of-00002.bin",
            "pytorch_model-00002-of-00002.bin",
            "pytorch_model.bin.index.json",
            "unet/diffusion_pytorch_model.bin",
            "unet/diffusion_pytorch_model.safetensors",
            "adapter_model.bin",
            "ema.bin",
        ],
    );
    let w = walk(&dir, false, &Overrides::default()).unwrap();
    assert_eq!(
        rels(&w.weights),
        [
            "adapter_model.safetensors",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "unet/diffusion_pytorch_model.safetensors"
        ]
    );
    assert_eq!(
        w.weights[1].src_rel.as_deref(),
        Some(OsStr::new("pytorch_model-00001-of-00002.bin"))
    );
    assert_eq!(w.weights[3].src_rel, None);
    assert_eq!(rels(&w.indexes), ["model.safetensors.index.json"]);
    assert_eq!(rels(&w.others), ["ema.bin"]);
    let skipped: Vec<_> = w
        .skipped
        .iter()
        .map(|(f, why)| (f.source_rel().to_str().unwrap(), *why))
        .collect();
    assert_eq!(skipped, [("unet/diffusion_pytorch_model.bin", SUPERSEDED)]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn names_of_the_hugging_face_layouts() {
    let cases: &[(&str, Option<&str>)] = &[
        ("pytorch_model.bin", Some("model.safetensors")),
        (
            "pytorch_model-00001-of-00003.bin",
            Some("model-00001-of-00003.safetensors"),
        ),
        (
            "diffusion_pytorch_model.bin.index.json",
            Some("diffusion_pytorch_model.safetensors.index.json"),
        ),
        ("adapter_model.bin", Some("adapter_model.safetensors")),
        ("pytorch_model-1.bin", None),
        ("pytorch_model-a-of-2.bin", None),
        ("pytorch_model_x.bin", None),
        ("pytorch_model.pt", None),
        ("model.bin", None),
    ];
    for (name, want) in cases {
        let got = torch_name(OsStr::new(name));
        assert_eq!(got.as_deref(), want.map(OsStr::new), "{name}");
    }
    for name in [
        "optimizer.pt",
        "optimizer_2.bin",
        "rng_state.pth",
        "rng_state_12.pth",
        "scaler.pt",
        "scheduler_1.pt",
        "random_states_12.pkl",
        "pytorch_model_fsdp_3.bin",
        "trainer_state.json",
    ] {
        assert!(is_trainer_state(name.as_bytes()), "{name}");
    }
    for name in [
        "rng_state_.pth",
        "rng_state_x.pth",
        "optimizer.pth",
        "my_optimizer.pt",
        "optimizer_x.bin",
        "scheduler_config.json",
        "random_states_.pkl",
        "pytorch_model_fsdp.bin",
    ] {
        assert!(!is_trainer_state(name.as_bytes()), "{name}");
    }
    let fam = |rel: &str| {
        let (a, b) = family(OsStr::new(rel));
        (a.to_vec(), b.to_vec())
    };
    assert_eq!(
        fam("unet/diffusion_pytorch_model-00001-of-00002.safetensors"),
        (b"unet".to_vec(), b"diffusion_pytorch_model".to_vec())
    );
    assert_eq!(
        fam("model.safetensors.index.json"),
        (vec![], b"model".to_vec())
    );
    assert_eq!(
        shard_numbers(b"a-1-of-2-03-of-04.safetensors"),
        Some((&b"a-1-of-2"[..], &b"03"[..], &b"04"[..]))
    );
    assert_eq!(shard_numbers(b"model.safetensors"), None);
    for s in ["-of-2", "x-1-of-", "x1-of-2", "x-1-2", "x--of-2"] {
        assert_eq!(split_shard(s.as_bytes()), None, "{s}");
    }
    assert_eq!(
        split_shard(b"-1-of-2"),
        Some((&b""[..], &b"1"[..], &b"2"[..]))
    );
}

#[test]
fn an_incomplete_set_of_shards_is_refused_unless_indexed() {
    let dir = folder(
        "incomplete",
        &[
            "model-00001-of-00004.safetensors",
            "model-00004-of-00004.safetensors",
        ],
    );
    let e = walk(&dir, false, &Overrides::default()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Refused);
    assert_eq!(
        e.path(),
        Some(Path::new("model-00002-of-00004.safetensors"))
    );
    assert_eq!(
        e.template(),
        "model-00002-of-00004.safetensors: missing (and 1 more): the shards model-*-of-00004 \
         are incomplete (an interrupted download?); nothing was written"
    );
    // PyTorch shards of the same name beside them are said not to be used.
    std::fs::write(dir.join("pytorch_model-00002-of-00004.bin"), "").unwrap();
    let e = walk(&dir, false, &Overrides::default()).unwrap_err();
    assert!(matches!(
        problem(&e),
        WalkProblem::Incomplete {
            pytorch: true,
            more: 1,
            ..
        }
    ));
    assert!(e
        .message()
        .contains("the PyTorch shards beside them are not used"));
    // An index says which shards there are: it is checked against them later.
    std::fs::write(dir.join("model.safetensors.index.json"), "{}").unwrap();
    walk(&dir, false, &Overrides::default()).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn two_files_under_one_name_are_refused() {
    // No model*.safetensors weights: the PyTorch index is renamed onto the other index.
    let dir = folder(
        "same",
        &[
            "pytorch_model.bin.index.json",
            "model.safetensors.index.json",
        ],
    );
    let e = walk(&dir, false, &Overrides::default()).unwrap_err();
    let WalkProblem::SameName { rel, other } = problem(&e) else {
        panic!("{e:?}")
    };
    assert_eq!(rel, Path::new("model.safetensors.index.json"));
    assert_eq!(
        e.path(),
        Some(dir.join("pytorch_model.bin.index.json").as_path())
    );
    assert_eq!(other, &dir.join("model.safetensors.index.json"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn links_are_followed_only_within_the_source_or_into_hub_blobs() {
    let dir = folder("links", &["model.safetensors", "sub/a.txt"]);
    let away = dir.with_extension("away");
    let _ = std::fs::remove_dir_all(&away);
    std::fs::create_dir_all(away.join("outer")).unwrap();
    std::fs::write(away.join("secret"), "").unwrap();
    std::fs::write(away.join("outer/b.txt"), "").unwrap();
    // A file link inside the source: followed, under the link's name.
    symlink("sub/a.txt", dir.join("alias.txt")).unwrap();
    let w = walk(&dir, false, &Overrides::default()).unwrap();
    assert_eq!(rels(&w.others), ["alias.txt", "sub/a.txt"]);
    // A file link out of it: refused, naming it, unless followed.
    symlink(away.join("secret"), dir.join("secret")).unwrap();
    let e = walk(&dir, false, &Overrides::default()).unwrap_err();
    assert!(
        matches!(&e, Error::LinkOutside { link, folder: false, .. } if *link == dir.join("secret")),
        "{e:?}"
    );
    assert!(walk(&dir, true, &Overrides::default()).is_ok());
    std::fs::remove_file(dir.join("secret")).unwrap();
    // A folder link out of it: refused unless followed; followed, its files are walked.
    symlink(away.join("outer"), dir.join("outer")).unwrap();
    let e = walk(&dir, false, &Overrides::default()).unwrap_err();
    assert!(
        matches!(e, Error::LinkOutside { folder: true, .. }),
        "{e:?}"
    );
    let w = walk(&dir, true, &Overrides::default()).unwrap();
    assert_eq!(rels(&w.others), ["alias.txt", "outer/b.txt", "sub/a.txt"]);
    assert_eq!(w.dirs, ["outer", "sub"]);
    // A folder link back to the source: a loop, when followed.
    symlink(&dir, away.join("outer/back")).unwrap();
    let e = walk(&dir, true, &Overrides::default()).unwrap_err();
    assert_eq!(problem(&e), &WalkProblem::Loop);
    assert_eq!(e.path(), Some(dir.join("outer/back").as_path()));
    std::fs::remove_file(away.join("outer/back")).unwrap();
    std::fs::remove_file(dir.join("outer")).unwrap();
    // A folder link inside it: refused either way (its files would be written twice).
    symlink("sub", dir.join("twice")).unwrap();
    for follow in [false, true] {
        let e = walk(&dir, follow, &Overrides::default()).unwrap_err();
        let WalkProblem::LinkInside { target } = problem(&e) else {
            panic!("{e:?}")
        };
        assert_eq!(target, &dir.join("sub").canonicalize().unwrap());
    }
    std::fs::remove_file(dir.join("twice")).unwrap();
    // A broken link: named as such.
    symlink("nowhere", dir.join("broken")).unwrap();
    let e = walk(&dir, true, &Overrides::default()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    assert_eq!(
        e.template(),
        format!("{}: broken symlink", dir.join("broken").display())
    );
    std::fs::remove_file(dir.join("broken")).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&away).unwrap();
}

#[test]
fn a_hub_cache_snapshot_is_walked_through_its_blobs() {
    let repo = folder("hub", &[]).join("models--org--name");
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(repo.join("snapshots/abc/sub")).unwrap();
    for (blob, name) in [("01", "model.safetensors"), ("02", "config.json")] {
        std::fs::write(repo.join("blobs").join(blob), blob).unwrap();
        symlink(
            format!("../../blobs/{blob}"),
            repo.join("snapshots/abc").join(name),
        )
        .unwrap();
    }
    symlink(
        "../../../blobs/01",
        repo.join("snapshots/abc/sub/model.safetensors"),
    )
    .unwrap();
    let w = walk(&repo.join("snapshots/abc"), false, &Overrides::default()).unwrap();
    assert_eq!(
        rels(&w.weights),
        ["model.safetensors", "sub/model.safetensors"]
    );
    assert_eq!(rels(&w.configs), ["config.json"]);
    assert_eq!(w.weights[0].size, 2);
    // A blob of something that is not a cache repo is not one.
    let other = repo.parent().unwrap().join("plain/blobs");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("03"), "").unwrap();
    symlink(other.join("03"), repo.join("snapshots/abc/x.txt")).unwrap();
    let e = walk(&repo.join("snapshots/abc"), false, &Overrides::default()).unwrap_err();
    assert!(matches!(e, Error::LinkOutside { .. }), "{e:?}");
    std::fs::remove_dir_all(repo.parent().unwrap()).unwrap();
}

#[test]
fn special_files_are_refused_and_listings_keep_them() {
    let dir = folder("special", &["model.safetensors", "d/x", ".stcast-tmp"]);
    let fifo = std::ffi::CString::new(dir.join("fifo").as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid C path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    let e = walk(&dir, false, &Overrides::default()).unwrap_err();
    assert_eq!(problem(&e), &WalkProblem::NotRegular);
    assert_eq!(e.kind(), ErrorKind::Refused);
    // A destination's listing: every file but bookkeeping, links not followed.
    symlink("d", dir.join("link")).unwrap();
    assert_eq!(
        listing(&dir).unwrap(),
        ["d/x", "fifo", "link", "model.safetensors"]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
