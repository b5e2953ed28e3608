use super::*;
use crate::given::Given;
use crate::run::walk::TRAINER;

/// A fresh folder holding `files` (relative path, bytes).
fn folder(tag: &str, files: &[(&str, Vec<u8>)]) -> PathBuf {
    crate::testutil::folder_of(&format!("inspect-{tag}"), files)
}

/// A safetensors file of 2x2 F32 tensors named `names`.
fn f32s(names: &[&str]) -> Vec<u8> {
    crate::testutil::f32s(names, 2)
}

fn given(to: &str, keep: &[&str]) -> Settings {
    Settings {
        to: Some(Given {
            text: Some(to.into()),
            whole: None,
            repr: format!("'{to}'"),
        }),
        keep: keep.iter().map(|k| k.to_string()).collect(),
        ..Settings::default()
    }
}

fn inspect(src: &Path, given: &Settings, scan: bool, checked: bool) -> Result<FolderInspection> {
    reshard(src, given, scan, checked, false)
}

fn reshard(
    src: &Path,
    given: &Settings,
    scan: bool,
    checked: bool,
    resharding: bool,
) -> Result<FolderInspection> {
    let tuning = Tuning::new(&Default::default()).unwrap();
    let mut planning = Planning::new(src, given, tuning, scan, checked, resharding)?;
    crate::task::run(&mut planning)?;
    let mut task = InspectFolderTask::new(planning)?;
    crate::task::run(&mut task)?;
    task.finish()
}

const INDEX: &str = r#"{"metadata": {"total_size": 32}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}}"#;

fn hf(tag: &str) -> PathBuf {
    folder(
        tag,
        &[
            ("model-00001-of-00002.safetensors", f32s(&["a.weight"])),
            ("model-00002-of-00002.safetensors", f32s(&["b.weight"])),
            ("model.safetensors.index.json", INDEX.into()),
            ("config.json", br#"{"torch_dtype": "float32"}"#.to_vec()),
            ("tokenizer.json", b"{}".to_vec()),
            ("trainer_state.json", b"{}".to_vec()),
        ],
    )
}

#[test]
fn an_hf_folder_is_described_file_by_file() {
    let src = hf("describe");
    let found = inspect(&src, &given("bf16", &["nothing.*"]), false, false).unwrap();
    let rels: Vec<&str> = found
        .files
        .iter()
        .map(|(r, _)| r.to_str().unwrap())
        .collect();
    assert_eq!(
        rels,
        [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors"
        ]
    );
    let r = &found.rows;
    assert_eq!(
        (r.data_bytes, r.tensors_converted, r.scanned),
        (32, 2, false)
    );
    // Two files, each a header and 16 bytes of BF16, and the other files as they are.
    let (other_files, left_out, warnings) = &found.named;
    let others: Vec<(&str, &str)> = other_files
        .iter()
        .map(|(p, _, action)| (p.to_str().unwrap(), *action))
        .collect();
    assert_eq!(
        others,
        [
            ("config.json", "rewritten"),
            ("model.safetensors.index.json", "rewritten"),
            ("tokenizer.json", "copied"),
        ]
    );
    let outputs: u64 = found.files.iter().map(|(_, f)| f.rows().output_bytes).sum();
    assert_eq!(r.output_bytes, outputs + r.other_bytes);
    let left: Vec<(&str, &str)> = left_out
        .iter()
        .map(|(p, _, why)| (p.to_str().unwrap(), *why))
        .collect();
    assert_eq!(left, [("trainer_state.json", TRAINER)]);
    // The pattern matched no tensor of any file: said once, first; then the file left out.
    let kinds: Vec<&str> = warnings.iter().map(|w| w.0).collect();
    assert_eq!(kinds, ["unmatched_pattern", "skipped_files"]);
    assert_eq!(r.keep_unmatched, ["nothing.*"]);
    assert!(warnings[1].1.contains("`trainer_state.json` (2 B)"));
}

#[test]
fn a_checked_folder_is_planned_as_the_run_plans_it() {
    let src = hf("checked");
    let found = inspect(&src, &given("fp16", &[]), true, true).unwrap();
    let r = &found.rows;
    assert!(r.scanned);
    assert_eq!(found.files.len(), 2);
    assert!(found.files.iter().all(|(_, f)| f.scanned.is_some()));
    // The index is written anew, the config with its new dtype.
    let rewritten: Vec<&str> = found
        .named
        .0
        .iter()
        .filter(|(_, _, action)| *action == "rewritten")
        .map(|(p, _, _)| p.to_str().unwrap())
        .collect();
    assert_eq!(rewritten, ["config.json", "model.safetensors.index.json"]);
}

#[test]
fn a_folder_without_weights_is_refused() {
    let src = folder("none", &[("config.json", b"{}".to_vec())]);
    let e = inspect(&src, &given("bf16", &[]), false, false)
        .err()
        .unwrap();
    assert!(matches!(
        e,
        Error::Walk {
            problem: WalkProblem::NoWeights,
            ..
        }
    ));
}

#[test]
fn an_fp8_target_refuses_a_model_config_that_is_not_an_object() {
    let src = folder(
        "fp8-list",
        &[
            ("model.safetensors", f32s(&["a.weight"])),
            ("config.json", b"[1, 2]".to_vec()),
        ],
    );
    let e = inspect(&src, &given("fp8", &[]), false, false)
        .err()
        .unwrap();
    assert!(matches!(
        e,
        Error::FolderConfig {
            problem: ConfigProblem::NotAnObject,
            ..
        }
    ));
}

#[test]
fn a_resharding_writes_its_own_indexes_and_may_read_one_file() {
    let src = hf("reshard");
    let found = reshard(&src, &given("bf16", &[]), false, true, true).unwrap();
    let others: Vec<&str> = found
        .named
        .0
        .iter()
        .map(|o| o.0.to_str().unwrap())
        .collect();
    assert_eq!(others, ["config.json", "tokenizer.json"]);
    // One file, named by its name; an FP8 target's quantization_config goes beside it.
    let one = src.join("model-00001-of-00002.safetensors");
    let found = reshard(&one, &given("fp8", &[]), false, true, true).unwrap();
    let rels: Vec<&str> = found
        .files
        .iter()
        .map(|(r, _)| r.to_str().unwrap())
        .collect();
    assert_eq!(rels, ["model-00001-of-00002.safetensors"]);
    let others: Vec<(&str, &str)> = found
        .named
        .0
        .iter()
        .map(|o| (o.0.to_str().unwrap(), o.2))
        .collect();
    assert_eq!(others, [(FOLDER_SIDE_CONFIG, "rewritten")]);
}
