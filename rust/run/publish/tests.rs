use super::*;

use crate::run::json::Node;
use crate::run::manifest::{owned, MANIFEST};

/// A fresh, empty folder.
fn folder(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("stcast-publish-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn options() -> Node<'static> {
    owned(&json::parse(r#"{"to": "bf16"}"#).unwrap())
}

fn os(rels: &[&str]) -> Vec<OsString> {
    rels.iter().map(OsString::from).collect()
}

/// A whole-folder run into `dst` planning `planned`, its manifest not yet saved.
fn writer(dst: &Path, planned: &[&str], ours: Vec<(OsString, Ident)>, force: bool) -> Writer {
    let src = Path::new("/nonexistent/src");
    let m = Manifest::new(src, (1, 2), dst, options(), None, None, os(planned));
    Writer::new(m, ours, Vec::new(), force)
}

fn ident(path: &Path) -> Ident {
    let m = std::fs::symlink_metadata(path).unwrap();
    (m.dev(), m.ino())
}

/// A file written or copied whole in one go: sealed, claimed, published, recorded (a run
/// steps these itself, to hear Ctrl-C in between).
impl Writer {
    fn write(&mut self, rel: &OsStr, kind: &str, content: &[u8]) -> Result<()> {
        let out = self.seal_text(rel, content).map_err(|e| self.rival(e))?;
        self.claim(rel, &out)?;
        let done = out.publish().map_err(|e| self.rival(e))?;
        self.published(rel, kind, Some(done.into()), None)?;
        Ok(())
    }

    fn copy(&mut self, rel: &OsStr, kind: &str, src: &Path) -> Result<()> {
        let mut copy = self.start_copy(rel, src).map_err(|e| self.rival(e))?;
        while !copy.step(u64::MAX)? {}
        let out = copy.seal()?;
        self.claim(rel, &out)?;
        let done = out.publish().map_err(|e| self.rival(e))?;
        self.published(rel, kind, Some(done.into()), None)?;
        Ok(())
    }
}

fn manifest_problem(e: Error) -> ManifestProblem {
    match e {
        Error::Manifest { problem, .. } => problem,
        e => panic!("{e:?}"),
    }
}

#[test]
fn a_run_writes_claims_and_records_then_removes_its_manifest() {
    let dst = folder("write").join("out");
    let mut w = writer(&dst, &["a/config.json", "b.bin"], Vec::new(), false);
    w.make_folders(&os(&["a/config.json"])).unwrap();
    w.begin(HashSet::new(), false).unwrap();
    assert!(dst.join(MANIFEST).is_file());
    w.write(OsStr::new("a/config.json"), "config", b"{}")
        .unwrap();
    let src = dst.parent().unwrap().join("src.bin");
    std::fs::write(&src, b"0123456789").unwrap();
    w.copy(OsStr::new("b.bin"), "copy", &src).unwrap();
    assert_eq!(std::fs::read(dst.join("a/config.json")).unwrap(), b"{}");
    assert_eq!(std::fs::read(dst.join("b.bin")).unwrap(), b"0123456789");
    assert_eq!(w.record.written(), os(&["a/config.json", "b.bin"]));
    w.recheck(&[]).unwrap();
    w.remove_own(&[]).unwrap();
    assert!(!dst.join(MANIFEST).exists());
}

#[test]
fn a_rollback_after_a_failure_removes_only_what_the_run_added() {
    let top = folder("rollback");
    let dst = top.join("new/out");
    let mut w = writer(&dst, &["sub/x.json", "old.json"], Vec::new(), false);
    w.make_folders(&os(&["sub/x.json", "old.json"])).unwrap();
    // A file that was there before the run (made after the survey for the test's sake).
    std::fs::write(dst.join("old.json"), b"old").unwrap();
    let before: HashSet<OsString> = os(&["old.json"]).into_iter().collect();
    w.begin(before, false).unwrap();
    w.write(OsStr::new("sub/x.json"), "config", b"new").unwrap();
    // Publishing over a file it may not replace fails: a rival's file, says the run.
    let e = w.write(OsStr::new("old.json"), "config", b"x").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::DestinationExists);
    assert!(matches!(manifest_problem(e), ManifestProblem::Rival { .. }));
    w.roll_back();
    // What it added is gone, its folders too, up to what was there; the old file stays.
    assert!(!dst.join("sub").exists());
    assert!(!dst.join(MANIFEST).exists());
    assert_eq!(std::fs::read(dst.join("old.json")).unwrap(), b"old");
    assert!(top.join("new").is_dir(), "a folder holding a file stays");
}

#[test]
fn a_folder_run_that_made_nothing_else_leaves_no_folder_behind() {
    let top = folder("made");
    let dst = top.join("a/b/out");
    let mut w = writer(&dst, &["x/y.json"], Vec::new(), false);
    w.make_folders(&os(&["x/y.json"])).unwrap();
    w.begin(HashSet::new(), false).unwrap();
    w.write(OsStr::new("x/y.json"), "config", b"{}").unwrap();
    w.roll_back();
    assert!(!top.join("a").exists());
}

#[test]
fn a_manifest_saved_meanwhile_refuses_the_run() {
    let dst = folder("meanwhile");
    let mut w = writer(&dst, &[], Vec::new(), false);
    w.make_folders(&[]).unwrap();
    std::fs::write(dst.join(MANIFEST), b"{}").unwrap();
    let e = w.begin(HashSet::new(), false).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Refused);
    assert!(matches!(
        manifest_problem(e),
        ManifestProblem::StartedMeanwhile { .. }
    ));
    assert_eq!(std::fs::read(dst.join(MANIFEST)).unwrap(), b"{}");
}

#[test]
fn only_a_file_stcast_wrote_is_replaced() {
    let dst = folder("replace");
    std::fs::write(dst.join("ours.json"), b"1").unwrap();
    std::fs::write(dst.join("theirs.json"), b"2").unwrap();
    let ours = vec![(OsString::from("ours.json"), ident(&dst.join("ours.json")))];
    let mut w = writer(&dst, &["ours.json", "theirs.json"], ours, false);
    w.begin(HashSet::new(), false).unwrap();
    w.write(OsStr::new("ours.json"), "config", b"new").unwrap();
    assert_eq!(std::fs::read(dst.join("ours.json")).unwrap(), b"new");
    assert!(w
        .write(OsStr::new("theirs.json"), "config", b"new")
        .is_err());
    assert_eq!(std::fs::read(dst.join("theirs.json")).unwrap(), b"2");
}

#[test]
fn a_link_on_the_way_is_refused() {
    let dst = folder("link");
    std::os::unix::fs::symlink("/tmp", dst.join("sub")).unwrap();
    let w = writer(&dst, &["sub/x.json"], Vec::new(), false);
    let e = w.out_path(OsStr::new("sub/x.json")).unwrap_err();
    assert!(matches!(
        e,
        Error::Place {
            problem: PlaceProblem::InTheWay,
            ..
        }
    ));
}

#[test]
fn an_old_index_goes_first_only_when_it_would_point_a_loader_wrong() {
    let dst = folder("unpublish");
    let index = r#"{"weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors"}}"#;
    std::fs::write(dst.join("m.index.json"), index).unwrap();
    let ours = vec![(
        OsString::from("m.index.json"),
        ident(&dst.join("m.index.json")),
    )];
    let mut w = writer(&dst, &["m.index.json"], ours, false);
    let same: WeightMap = [("a", "m-1.safetensors"), ("b", "m-2.safetensors")]
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .into();
    let moved: WeightMap = [("a", "m-2.safetensors"), ("b", "m-1.safetensors")]
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .into();
    let writes: HashSet<OsString> = os(&["m-1.safetensors"]).into_iter().collect();
    // The same map: consistent whenever the run stops.
    let rel = OsString::from("m.index.json");
    w.unpublish(&[(rel.clone(), same)], &writes, &[]).unwrap();
    assert!(dst.join("m.index.json").exists());
    // Another map, but naming no file the run replaces: still consistent.
    w.unpublish(&[(rel.clone(), moved.clone())], &HashSet::new(), &[])
        .unwrap();
    assert!(dst.join("m.index.json").exists());
    w.unpublish(&[(rel.clone(), moved)], &writes, &[]).unwrap();
    assert!(!dst.join("m.index.json").exists());
    assert_eq!(w.replace_for(&rel), None);
}

#[test]
fn stale_shards_go_indexes_first_and_only_while_still_those_files() {
    let dst = folder("stale");
    for name in ["old-1.safetensors", "old.index.json", "moved.safetensors"] {
        std::fs::write(dst.join(name), name).unwrap();
    }
    let id = |n: &str| (OsString::from(n), ident(&dst.join(n)));
    let mut stale = vec![id("old-1.safetensors"), id("old.index.json")];
    // A file that is no longer the one a manifest recorded stays.
    stale.push((OsString::from("moved.safetensors"), (0, 0)));
    let mut w = writer(&dst, &[], Vec::new(), false);
    w.remove_stale(&stale).unwrap();
    assert!(!dst.join("old-1.safetensors").exists());
    assert!(!dst.join("old.index.json").exists());
    assert!(dst.join("moved.safetensors").exists());
}

#[test]
fn a_failed_final_recheck_withdraws_the_cues() {
    let dst = folder("recheck");
    let mut w = writer(&dst, &["w.safetensors", "config.json"], Vec::new(), false);
    w.begin(HashSet::new(), false).unwrap();
    w.write(OsStr::new("w.safetensors"), "weights", b"w")
        .unwrap();
    w.write(OsStr::new("config.json"), "config", b"{}").unwrap();
    // Another program replaced the weights during the run.
    std::fs::remove_file(dst.join("w.safetensors")).unwrap();
    std::fs::write(dst.join("w.safetensors"), b"other").unwrap();
    let e = w.recheck(&os(&["config.json"])).unwrap_err();
    assert!(matches!(manifest_problem(e), ManifestProblem::Changed));
    assert!(!dst.join("config.json").exists());
    assert_eq!(std::fs::read(dst.join("w.safetensors")).unwrap(), b"other");
}

#[test]
fn a_failed_conversion_rolls_back_unless_resume_can_go_on() {
    let bad = || Error::InvalidHeader {
        path: PathBuf::from("in.safetensors"),
        reason: "bad".into(),
    };
    // Bad input: `--resume` would fail again; what the run added goes.
    let dst = folder("failed-bad");
    let mut w = writer(&dst, &["a.json", "b.json"], Vec::new(), false);
    w.begin(HashSet::new(), false).unwrap();
    w.write(OsStr::new("a.json"), "weights", b"a").unwrap();
    let e = w.failed(bad());
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    assert!(!dst.join("a.json").exists() && !dst.join(MANIFEST).exists());

    // A file changed in DST since the survey: what is done stays for `--resume`.
    let dst = folder("failed-changed");
    let mut w = writer(&dst, &["a.json", "b.json"], Vec::new(), false);
    w.begin(HashSet::new(), false).unwrap();
    w.write(OsStr::new("a.json"), "weights", b"a").unwrap();
    let path = dst.join("b.json");
    w.failed(Error::NotOurs { path });
    assert!(dst.join("a.json").exists() && dst.join(MANIFEST).exists());

    // A rival's file: what the run finished stays; having written nothing, the run takes
    // its manifest back.
    let dst = folder("failed-rival");
    let mut w = writer(&dst, &["a.json", "b.json"], Vec::new(), false);
    w.begin(HashSet::new(), false).unwrap();
    let rival = |dst: &Path| Error::DestinationExists {
        path: dst.join("b.json"),
    };
    w.failed(rival(&dst));
    assert!(!dst.join(MANIFEST).exists());
    let mut w = writer(&dst, &["a.json", "b.json"], Vec::new(), false);
    w.begin(HashSet::new(), false).unwrap();
    w.write(OsStr::new("a.json"), "weights", b"a").unwrap();
    w.failed(rival(&dst));
    assert!(dst.join("a.json").exists() && dst.join(MANIFEST).exists());

    // An input that changed while it was read: as bad input.
    let dst = folder("failed-changed-input");
    let mut w = writer(&dst, &["a.json", "b.json"], Vec::new(), false);
    w.begin(HashSet::new(), false).unwrap();
    w.write(OsStr::new("a.json"), "weights", b"a").unwrap();
    let change = "its size went from 2 to 1 bytes".to_string();
    let path = PathBuf::from("in.safetensors");
    let e = w.failed(Error::InputChanged { path, change });
    assert_eq!(e.kind(), ErrorKind::InputChanged);
    assert!(!dst.join("a.json").exists() && !dst.join(MANIFEST).exists());

    // A weight's files not what the plan read, found as its conversion begins: as bad input.
    let dst = folder("failed-input");
    let mut w = writer(&dst, &["a.json", "b.json"], Vec::new(), false);
    w.begin(HashSet::new(), false).unwrap();
    w.write(OsStr::new("a.json"), "weights", b"a").unwrap();
    w.failed_input().unwrap();
    assert!(!dst.join("a.json").exists() && !dst.join(MANIFEST).exists());
}
