use std::path::Path;

use super::*;
use crate::task;
use crate::testutil::{f32s, folder_of, sharded_hf, text, whole};

fn convert(src: &Path, dst: Option<&Path>, s: &Settings) -> Result<ConvertDone> {
    let mut run = Convert::new(src, dst, s, Tuning::default())?;
    task::run(&mut run)?;
    run.finish()
}

fn verify(src: &Path, dst: &Path, s: &Settings) -> Result<Verified> {
    let mut run = Verify::new(src, dst, s, Tuning::default())?;
    task::run(&mut run)?;
    run.finish()
}

#[test]
fn a_file_is_converted_to_its_default_name_and_verified() {
    let dir = folder_of("command-file", &[("w.safetensors", f32s(&["a", "b"], 4))]);
    let src = dir.join("w.safetensors");
    let done = convert(&src, None, &Settings::default()).unwrap();
    let ConvertDone::File { report, .. } = done else {
        panic!("a file is one file's run");
    };
    assert_eq!(report.dst, dir.join("w-bf16.safetensors"));
    assert!(report.dst.is_file());
    // DST the folder it is in: the file convert named there.
    let Verified::File(r, _) = verify(&src, &dir, &Settings::default()).unwrap() else {
        panic!("a file is verified as one");
    };
    assert!(r.is_ok());
    // Again: the output is there, and not replaced.
    let again = convert(&src, None, &Settings::default());
    assert!(matches!(again, Err(Error::DestinationExists { .. })));
}

#[test]
fn a_folder_of_files_and_a_re_sharding_are_folder_runs() {
    let src = sharded_hf("command-folder", &[]);
    let dst = src.with_extension("out");
    let done = convert(&src, Some(&dst), &Settings::default()).unwrap();
    assert!(matches!(done, ConvertDone::Folder(ref r, _) if r.folder));
    assert!(
        matches!(verify(&src, &dst, &Settings::default()).unwrap(), Verified::Folder(r) if r.is_ok())
    );
    // One file re-sharded is a folder run too, into the folder DST names.
    let one = src.join("model-00001-of-00002.safetensors");
    let cut = src.with_extension("cut");
    let s = Settings {
        max_shard_size: Some(whole(100)),
        ..Settings::default()
    };
    assert!(matches!(
        convert(&one, Some(&cut), &s).unwrap(),
        ConvertDone::Folder(..)
    ));
    // An inspection of it with DST says where the output goes and whether it fits.
    let mut dry = Inspect::new(
        &src,
        Some(&dst.with_extension("dry")),
        &s,
        Tuning::default(),
    )
    .unwrap();
    task::run(&mut dry).unwrap();
    let Inspected::Folder(_, Some(at)) = dry.finish().unwrap() else {
        panic!("a folder's dry run with DST has its destination");
    };
    assert!(at.fits && at.need_bytes > 0);
}

#[test]
fn an_option_that_does_not_apply_is_refused_before_anything_is_written() {
    let dir = folder_of("command-applies", &[("w.safetensors", f32s(&["a"], 4))]);
    let src = dir.join("w.safetensors");
    let s = Settings {
        resume: true,
        to: Some(text("fp16")),
        ..Settings::default()
    };
    let e = Convert::new(&src, None, &s, Tuning::default())
        .err()
        .unwrap();
    assert!(
        matches!(
            e,
            Error::NotApplicable {
                option: OptionName::Resume,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(!dir.join("w-fp16.safetensors").exists());
}
