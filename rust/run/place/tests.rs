use std::os::unix::fs::symlink;

use super::*;
use crate::vocab::{ErrorKind, OptionName};

fn folder(tag: &str, files: &[&str]) -> PathBuf {
    crate::testutil::folder(&format!("place-{tag}"), files)
}

fn problem(r: Result<impl std::fmt::Debug>) -> (PathBuf, PlaceProblem) {
    match r {
        Err(e @ Error::Place { .. }) => {
            assert_eq!(e.kind(), ErrorKind::Refused);
            let Error::Place { path, problem } = e else {
                unreachable!()
            };
            (path, problem)
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn paths_are_cut_as_python_cuts_them() {
    // Expected values from Python's os.path.normpath, splitext and str.split.
    for (path, want) in [
        ("a/b/../c", "a/c"),
        ("/..", "/"),
        ("//x", "//x"),
        ("///x", "/x"),
        ("", "."),
        ("./", "."),
        ("a/./b/", "a/b"),
        ("../..", "../.."),
        ("a/..", "."),
        ("x/../../y", "../y"),
    ] {
        assert_eq!(normpath(path.as_bytes()), want.as_bytes(), "{path}");
    }
    for (path, want) in [
        ("a/b.c.d", "a/b.c"),
        (".bashrc", ".bashrc"),
        ("...", "..."),
        ("a.b.", "a.b"),
        ("dir.x/file", "dir.x/file"),
        ("x.tar.gz", "x.tar"),
    ] {
        assert_eq!(strip_ext(path.as_bytes()), want.as_bytes(), "{path}");
    }
    for (name, want) in [
        ("models--org--name", "name"),
        ("a---x", "-x"),
        ("a--", ""),
        ("x", "x"),
    ] {
        assert_eq!(last_part(name.as_bytes()), want.as_bytes(), "{name}");
    }
    assert_eq!(strip(" \t\x1c abc\x0b\n"), "abc");
}

#[test]
fn default_destinations_by_kind_of_source() {
    let dir = folder(
        "dst",
        &[
            "hf/model.safetensors",
            "models--org--name/snapshots/abc/model.safetensors",
            "dcp/.metadata",
            "dcp/__0_0.distcp",
            "w.bin",
            "x.safetensors",
        ],
    );
    let at = |p: &str| dir.join(p);
    let dst = |p: &str, t: Target, f: bool| default_dst(&at(p), t, f).unwrap();
    assert_eq!(dst("hf", Target::Bf16, false), at("hf-bf16"));
    assert_eq!(dst("hf/", Target::F16, true), at("hf-fp16"));
    assert_eq!(
        dst("models--org--name", Target::Bf16, false),
        at("name-bf16")
    );
    assert_eq!(
        dst("dcp", Target::Bf16, false),
        at("dcp-bf16/model.safetensors")
    );
    assert_eq!(dst("dcp", Target::Keep, true), at("dcp-safetensors"));
    assert_eq!(dst("w.bin", Target::Keep, false), at("w.safetensors"));
    assert_eq!(
        dst("x.safetensors", Target::Keep, false),
        at("x-keep.safetensors")
    );
    assert_eq!(
        dst("x.safetensors", Target::Fp8, false),
        at("x-fp8.safetensors")
    );
    assert_eq!(dst("x.safetensors", Target::Bf16, true), at("x-bf16"));
    // `.` is named after the folder, beside it.
    let dot = dir.join("hf/.");
    let want = path_of(normpath(dir.join("hf/../hf-bf16").as_os_str().as_bytes()));
    assert_eq!(default_dst(&dot, Target::Bf16, false).unwrap(), want);
}

#[test]
fn a_hub_repo_root_reads_its_snapshot() {
    let dir = folder(
        "hub",
        &[
            "models--o--n/snapshots/aaa/",
            "models--o--n/snapshots/bbb/",
            "plain/x",
        ],
    );
    let repo = dir.join("models--o--n");
    assert_eq!(
        source_folder(&dir.join("plain")).unwrap(),
        dir.join("plain")
    );
    let (path, p) = problem(source_folder(&repo));
    assert_eq!(path, repo);
    assert!(matches!(p, PlaceProblem::Snapshots { ref found, .. } if found.len() == 2));
    assert!(Error::Place { path, problem: p }
        .template()
        .contains("2 snapshots (aaa, bbb)"));
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), " bbb\n").unwrap();
    assert_eq!(source_folder(&repo).unwrap(), repo.join("snapshots/bbb"));
    for bad in ["..", "", "ccc", "aaa/../bbb"] {
        std::fs::write(repo.join("refs/main"), bad).unwrap();
        let (path, _) = problem(source_folder(&repo));
        assert_eq!(path, repo.join("refs/main"), "{bad}");
    }
    std::fs::remove_file(repo.join("refs/main")).unwrap();
    std::fs::remove_dir(repo.join("snapshots/aaa")).unwrap();
    assert_eq!(source_folder(&repo).unwrap(), repo.join("snapshots/bbb"));
}

#[test]
fn a_destination_inside_beside_or_around_the_source() {
    let dir = folder(
        "around",
        &["src/sub/x", "file", "dcp/.metadata", "dcp/__0_0.distcp"],
    );
    let src = dir.join("src");
    check_source(&src, &dir.join("out"), false).unwrap();
    check_source(&src, &dir.join("new/deeper"), false).unwrap();
    for inside in ["src", "src/sub", "src/new/out", "src/sub/../new"] {
        let (path, p) = problem(check_source(&src, &dir.join(inside), false));
        assert_eq!(
            (path, p),
            (dir.join(inside), PlaceProblem::DstInSource),
            "{inside}"
        );
    }
    // Through a link: the same folder by identity.
    symlink(&src, dir.join("link")).unwrap();
    assert_eq!(
        problem(check_source(&src, &dir.join("link/out"), false)).1,
        PlaceProblem::DstInSource
    );
    assert_eq!(
        problem(check_source(&src, &dir, false)).1,
        PlaceProblem::DstHoldsSource
    );
    assert_eq!(
        problem(check_source(&src, &dir.join("file"), false)).1,
        PlaceProblem::DstNotAFolder { resharding: false }
    );
    assert_eq!(
        problem(check_source(&dir.join("none"), &dir.join("out"), false)).1,
        PlaceProblem::Missing { folder: true }
    );
    assert_eq!(
        problem(check_source(&dir.join("file"), &dir.join("out"), false)).1,
        PlaceProblem::NotAFolder { file: false }
    );
    // Re-sharded: a file, or a checkpoint folder, read as one source.
    check_source(&dir.join("file"), &dir.join("out"), true).unwrap();
    assert_eq!(
        problem(check_source(&dir.join("file"), &dir.join("file"), true)).1,
        PlaceProblem::DstNotAFolder { resharding: true }
    );
    let dcp = dir.join("dcp");
    check_source(&dcp, &dir.join("out"), true).unwrap();
    assert_eq!(
        problem(check_source(&dcp, &dcp.join("out"), true)).1,
        PlaceProblem::DstInCheckpoint { src: dcp.clone() }
    );
    // A folder an entry of the checkpoint links to is part of it (a ZeRO tag folder).
    std::fs::create_dir(dir.join("tag")).unwrap();
    symlink(dir.join("tag"), dcp.join("global_step1")).unwrap();
    assert!(matches!(
        problem(check_source(&dcp, &dir.join("tag/out"), true)).1,
        PlaceProblem::DstInCheckpoint { .. }
    ));
}

#[test]
fn an_output_that_is_a_source_file_or_folder() {
    let dir = folder(
        "outputs",
        &["src/a.safetensors", "src/sub/b.safetensors", "dst/"],
    );
    let (src, dst) = (dir.join("src"), dir.join("dst"));
    let inputs = [src.join("a.safetensors"), src.join("sub/b.safetensors")];
    let rels = |r: &[&str]| r.iter().map(OsString::from).collect::<Vec<_>>();
    check_outputs(
        &src,
        &dst,
        &rels(&["a.safetensors", "sub/b.safetensors"]),
        &inputs,
    )
    .unwrap();
    std::fs::hard_link(&inputs[0], dst.join("a.safetensors")).unwrap();
    let (path, p) = problem(check_outputs(
        &src,
        &dst,
        &rels(&["a.safetensors"]),
        &inputs,
    ));
    assert_eq!(path, dst.join("a.safetensors"));
    assert_eq!(
        p,
        PlaceProblem::OutputIsInput {
            input: inputs[0].clone()
        }
    );
    // A folder of the source under DST (here a link; a bind mount alike).
    symlink(src.join("sub"), dst.join("sub")).unwrap();
    let (path, p) = problem(check_outputs(
        &src,
        &dst,
        &rels(&["sub/c.safetensors"]),
        &inputs,
    ));
    assert_eq!((path, p), (dst.join("sub"), PlaceProblem::OutputInSource));
}

#[test]
fn a_folder_run_named_like_a_file_is_a_usage_error() {
    let dir = folder("filelike", &["src/model.safetensors", "made.safetensors/"]);
    let src = dir.join("src");
    for (dst, resharding, want) in [
        ("x.safetensors", false, "x"),
        ("X.SafeTensors", true, "X"),
        ("sub/x.safetensors/", false, "sub/x"),
        (".safetensors", false, "out"),
    ] {
        let e = place(&src, Some(&dir.join(dst)), Target::Bf16, resharding, true).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Usage, "{dst}");
        assert_eq!(
            e.option(),
            resharding.then_some(crate::vocab::OptionName::MaxShardSize)
        );
        let Error::Place { path, problem } = e else {
            unreachable!()
        };
        assert_eq!(path, dir.join(dst));
        assert_eq!(
            problem,
            PlaceProblem::DstLikeFile {
                resharding,
                folder: dir.join(want)
            },
            "{dst}"
        );
        assert!(!dir.join(dst).exists(), "{dst}");
    }
    // A folder of that name is a folder; a file-like name inside a folder DST is no name
    // of DST's own; inspect without writing (check off) is not refused.
    place(
        &src,
        Some(&dir.join("made.safetensors")),
        Target::Bf16,
        false,
        true,
    )
    .unwrap();
    place(
        &src,
        Some(&dir.join("x.safetensors/out")),
        Target::Bf16,
        false,
        true,
    )
    .unwrap();
    place(
        &src,
        Some(&dir.join("x.safetensors")),
        Target::Bf16,
        false,
        false,
    )
    .unwrap();
}

#[test]
fn what_a_source_is() {
    let dir = folder(
        "kind",
        &[
            "hf/model.safetensors",
            "dcp/.metadata",
            "dcp/__0_0.distcp",
            "w.safetensors",
        ],
    );
    symlink(dir.join("nowhere"), dir.join("dangling")).unwrap();
    let kind = |p: &str| source(&dir.join(p), true).unwrap();
    assert_eq!(kind("hf"), SourceKind::Tree);
    assert_eq!(kind("hf/"), SourceKind::Tree);
    assert_eq!(kind("dcp"), SourceKind::Checkpoint);
    assert_eq!(kind("w.safetensors"), SourceKind::File);
    assert_eq!(kind("dangling"), SourceKind::File); // there: its read names it
    assert_eq!(kind("missing.safetensors"), SourceKind::Missing);
    let kinds = [
        SourceKind::Missing,
        SourceKind::File,
        SourceKind::Checkpoint,
        SourceKind::Tree,
    ];
    let names: Vec<_> = kinds.iter().map(|k| k.name()).collect();
    assert_eq!(
        names,
        [None, Some("file"), Some("checkpoint"), Some("tree")]
    );
}

#[test]
fn a_missing_source_like_a_hub_repo_says_how_to_download_it() {
    let repo = |p: &str| match source(Path::new(p), true) {
        Err(Error::Place {
            path,
            problem: PlaceProblem::HubRepo { repo },
        }) => {
            assert_eq!(path, Path::new(p));
            Some(repo)
        }
        Ok(SourceKind::Missing) => None,
        other => panic!("{p}: {other:?}"),
    };
    assert_eq!(
        repo("no-such-org-stcast/Model-7B").as_deref(),
        Some("no-such-org-stcast/Model-7B")
    );
    let url = "https://huggingface.co/org-x/name.v2/tree/main/sub";
    assert_eq!(repo(url).as_deref(), Some("org-x/name.v2"));
    assert_eq!(repo("hf://models/o/n/").as_deref(), Some("o/n"));
    assert_eq!(
        repo("https://example.com/a/b/c").as_deref(),
        Some("ORG/NAME")
    );
    // A local path's typo: a checkpoint's file, or a folder that is here ("rust/").
    assert_eq!(repo("no-such-org-stcast/model.SAFETENSORS"), None);
    assert_eq!(repo("rust/no-such-file"), None);
    assert_eq!(repo("/abs/path"), None);
    assert_eq!(repo("a/b/c"), None);
    // Word characters are letters, numbers and `_`: not a combining mark or a connector.
    assert_eq!(repo("org\u{b2}/m").as_deref(), Some("org\u{b2}/m"));
    assert_eq!(repo("org/mod\u{e8}le").as_deref(), Some("org/mod\u{e8}le"));
    assert_eq!(repo("orge\u{301}/m"), None);
    assert_eq!(repo("org\u{203f}/m"), None);
    // Bytes that are not UTF-8: no repo, but a URL of them is still one.
    let bytes = |b: &[u8]| PathBuf::from(std::ffi::OsStr::from_bytes(b));
    let not_utf8 = |b: &[u8]| match source(&bytes(b), true) {
        Err(Error::Place {
            problem: PlaceProblem::HubRepo { repo },
            ..
        }) => Some(repo),
        Ok(SourceKind::Missing) => None,
        other => panic!("{other:?}"),
    };
    assert_eq!(not_utf8(b"https://\xff").as_deref(), Some("ORG/NAME"));
    assert_eq!(not_utf8(b"org/\xffm"), None);
    // Unchecked, it is only missing.
    let unchecked = source(Path::new("no-such-org-stcast/Model-7B"), false).unwrap();
    assert_eq!(unchecked, SourceKind::Missing);
    let e = source(Path::new("no-such-org-stcast/M"), true).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    assert_eq!(
        e.template(),
        "no-such-org-stcast/M: no such file or folder; stcast converts local files: download \
         it first, e.g. `hf download no-such-org-stcast/M --local-dir DIR`"
    );
}

#[test]
fn a_one_file_run_writes_into_a_folder_dst_its_default_name() {
    let dir = folder(
        "file-dst",
        &["w.safetensors", "out/", "dcp/.metadata", "dcp/__0_0.distcp"],
    );
    let at = |p: &str| dir.join(p);
    let dst = |src: &str, d: Option<&str>, t: Target| match d {
        Some(d) => file_dst(&at(src), &at(d), t).unwrap(),
        None => default_dst(&at(src), t, false).unwrap(),
    };
    assert_eq!(
        dst("w.safetensors", None, Target::Bf16),
        at("w-bf16.safetensors")
    );
    assert_eq!(dst("w.safetensors", Some("x.st"), Target::Bf16), at("x.st"));
    assert_eq!(
        dst("w.safetensors", Some("out"), Target::F16),
        at("out/w-fp16.safetensors")
    );
    assert_eq!(
        dst("w.safetensors", Some("new/"), Target::Bf16),
        at("new/w-bf16.safetensors")
    );
    assert_eq!(
        dst("w.safetensors", Some("new/.."), Target::Bf16),
        at("new/../w-bf16.safetensors")
    );
    // One checkpoint in a folder: a DST not named `*.safetensors` is the folder holding it.
    assert_eq!(
        dst("dcp", None, Target::Bf16),
        at("dcp-bf16/model.safetensors")
    );
    assert_eq!(
        dst("dcp", Some("hf"), Target::Bf16),
        at("hf/model.safetensors")
    );
    assert_eq!(
        dst("dcp", Some("o.SafeTensors"), Target::Bf16),
        at("o.SafeTensors")
    );
    assert_eq!(
        dst("dcp", Some("o.safetensors/"), Target::Bf16),
        at("o.safetensors/model.safetensors")
    );
}

#[test]
fn verify_pairs_a_file_with_what_convert_wrote_into_a_folder() {
    let dir = folder(
        "verify-route",
        &[
            "w.safetensors",
            "one/w-fp16.safetensors",
            "two/w-bf16.safetensors",
            "two/w-fp16.safetensors",
            "none/model-00001-of-00002.safetensors",
            "hf/model.safetensors",
            "dcp/.metadata",
            "dcp/__0_0.distcp",
        ],
    );
    let at = |p: &str| dir.join(p);
    let route = |src: &str, dst: &str, t: Option<Target>, named: bool| {
        verify_route(&at(src), &at(dst), t, named)
    };
    let ok = |src, dst, t| route(src, dst, t, false).unwrap();
    assert_eq!(
        ok("w.safetensors", "one", None),
        (at("one/w-fp16.safetensors"), false)
    );
    assert_eq!(
        ok("w.safetensors", "two", Some(Target::F16)),
        (at("two/w-fp16.safetensors"), false)
    );
    assert_eq!(ok("w.safetensors", "none", None), (at("none"), true));
    assert_eq!(
        ok("w.safetensors", "new/", None),
        (at("new/w-bf16.safetensors"), false)
    );
    assert_eq!(
        ok("w.safetensors", "x.safetensors", None),
        (at("x.safetensors"), false)
    );
    assert_eq!(ok("hf", "one", None), (at("one"), true));
    assert_eq!(ok("hf", "new", None), (at("new"), true));
    // A re-sharded stem given: the folder DST as it is; a file DST is a usage error.
    assert_eq!(
        route("w.safetensors", "one", None, true).unwrap(),
        (at("one"), true)
    );
    let e = route("w.safetensors", "x.safetensors", None, true).unwrap_err();
    assert_eq!(
        (e.kind(), e.option()),
        (ErrorKind::Usage, Some(OptionName::Name))
    );
    assert_eq!(e.path(), None);
    // Two targets' outputs and no target: a usage error of `to`, naming both.
    let e = route("w.safetensors", "two", None, false).unwrap_err();
    assert_eq!(
        (e.kind(), e.option()),
        (ErrorKind::Usage, Some(OptionName::To))
    );
    let want = format!(
        "{}: holds both w-bf16.safetensors and w-fp16.safetensors: name the file, or give {{to}}",
        at("two").display()
    );
    assert_eq!(e.template(), want);
    // A checkpoint to convert as DST: SRC and DST swapped.
    let e = route("w.safetensors", "dcp", None, false).unwrap_err();
    assert!(matches!(e, Error::NotAnOutput { .. }), "{e:?}");
}

#[test]
fn a_single_file_is_named_as_in_a_folder() {
    let dir = folder(
        "single",
        &[
            "m.safetensors",
            "pytorch_model.bin",
            "ema.pt",
            "..pt",
            "dcp/__0_0.distcp",
            "dcp/.metadata",
            "dcp/sub/",
        ],
    );
    let named = |name: &str| {
        let f = single_file(&dir.join(name)).unwrap();
        assert_eq!(f.size, name.len() as u64);
        (f.rel.into_string().unwrap(), f.src_rel)
    };
    assert_eq!(named("m.safetensors"), ("m.safetensors".into(), None));
    let renamed = |s: &str| Some(OsString::from(s));
    assert_eq!(
        named("pytorch_model.bin"),
        ("model.safetensors".into(), renamed("pytorch_model.bin"))
    );
    assert_eq!(
        named("ema.pt"),
        ("ema.safetensors".into(), renamed("ema.pt"))
    );
    // As os.path.splitext cuts it: a name's leading dots are no extension.
    assert_eq!(named("..pt"), ("..pt.safetensors".into(), renamed("..pt")));
    // One checkpoint in a folder: its regular files' total size, its entries' latest mtime.
    let f = single_file(&dir.join("dcp")).unwrap();
    let size = ("dcp/__0_0.distcp".len() + "dcp/.metadata".len()) as u64;
    assert_eq!(
        (f.rel, f.size, f.src_rel),
        ("model.safetensors".into(), size, renamed("."))
    );
    let newest = ["dcp/__0_0.distcp", "dcp/.metadata", "dcp/sub"]
        .map(|p| mtime_ns(&std::fs::metadata(dir.join(p)).unwrap()));
    assert_eq!(f.mtime_ns, newest.into_iter().max().unwrap());
    assert!(single_file(&dir.join("missing.pt")).is_err());
}
