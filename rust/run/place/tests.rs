use std::os::unix::fs::symlink;

use super::*;
use crate::vocab::ErrorKind;

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
