use super::*;
use crate::testutil::file;
use crate::vocab::ErrorKind;

/// A fresh folder holding `files` (relative path, bytes).
fn folder(tag: &str, files: &[(&str, Vec<u8>)]) -> PathBuf {
    crate::testutil::folder_of(&format!("plan-{tag}"), files)
}

/// A safetensors file of 2x2 F32 tensors named `names`.
fn f32s(names: &[&str]) -> Vec<u8> {
    crate::testutil::f32s(names, 2)
}

/// An FP8 (E4M3) weight `l.weight` with its per-channel scale.
fn fp8() -> Vec<u8> {
    let h = r#"{"l.weight":{"dtype":"F8_E4M3","shape":[2,2],"data_offsets":[0,4]},"l.weight_scale":{"dtype":"F32","shape":[2,1],"data_offsets":[4,12]}}"#;
    file(h, 12)
}

fn plan(src: &Path, to: &str) -> Result<FolderPlan> {
    let given = Settings {
        to: Some(Given {
            text: Some(to.into()),
            whole: None,
            repr: format!("'{to}'"),
        }),
        ..Settings::default()
    };
    let mut task = PlanTask::new(src, &given, Tuning::new(&Default::default()).unwrap(), true)?;
    crate::task::run(&mut task)?;
    task.finish()
}

fn rels(files: &[File]) -> Vec<&str> {
    files.iter().map(|f| f.rel.to_str().unwrap()).collect()
}

const INDEX: &str = r#"{"metadata": {"total_size": 32}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}}"#;

#[test]
fn an_hf_folder_with_an_index_is_planned_whole() {
    let src = folder(
        "hf",
        &[
            ("model-00001-of-00002.safetensors", f32s(&["a.weight"])),
            ("model-00002-of-00002.safetensors", f32s(&["b.weight"])),
            ("model.safetensors.index.json", INDEX.into()),
            ("config.json", br#"{"torch_dtype": "float32"}"#.to_vec()),
            ("tokenizer.json", b"{}".to_vec()),
        ],
    );
    let p = plan(&src, "bf16").unwrap();
    assert_eq!(
        rels(&p.weights),
        [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors"
        ]
    );
    assert_eq!(p.indexes.len(), 1);
    assert_eq!(p.indexes[0].2.len(), 2);
    let (config, text) = &p.configs[0];
    assert_eq!(config.rel, "config.json");
    assert_eq!(text.as_deref(), Some(r#"{"torch_dtype": "bfloat16"}"#));
    assert_eq!(rels(&p.copies), ["tokenizer.json"]);
    assert!(p.late_copies.is_empty() && !p.dequantize && p.model_config.is_none());
    assert_eq!(p.planned.len(), 2);
    for planned in &p.planned {
        assert_eq!(planned.out_data, 8);
        assert_eq!(planned.header_sha256.len(), 64);
        assert!(planned.unquantized.is_none());
        assert_eq!(planned.info["tensors_converted"], 1);
    }
    std::fs::remove_dir_all(src).unwrap();
}

#[test]
fn an_index_that_disagrees_with_its_shards_is_invalid_input() {
    let src = folder(
        "index",
        &[
            ("model-00001-of-00002.safetensors", f32s(&["a.weight"])),
            ("model-00002-of-00002.safetensors", f32s(&["c.weight"])),
            ("model.safetensors.index.json", INDEX.into()),
        ],
    );
    let e = plan(&src, "bf16").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    let want = "tensor `b.weight` is listed for `model-00002-of-00002.safetensors` but that \
                shard does not hold it";
    assert!(e.message().contains(want), "{}", e.message());
    std::fs::remove_dir_all(src).unwrap();
}

#[test]
fn a_shard_two_indexes_name_is_refused() {
    let other = r#"{"weight_map": {"a.weight": "model-00001-of-00002.safetensors"}}"#;
    let src = folder(
        "owners",
        &[
            ("model-00001-of-00002.safetensors", f32s(&["a.weight"])),
            ("model-00002-of-00002.safetensors", f32s(&["b.weight"])),
            ("model.safetensors.index.json", INDEX.into()),
            ("other.safetensors.index.json", other.into()),
        ],
    );
    let e = plan(&src, "bf16").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Refused);
    assert!(e
        .message()
        .contains("names model-00001-of-00002.safetensors, which"));
    std::fs::remove_dir_all(src).unwrap();
}

const FP8_CONFIG: &str = r#"{"torch_dtype": "bfloat16", "quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}}}}"#;

#[test]
fn a_quantized_fp8_folder_is_dequantized_and_its_config_loses_its_quantization() {
    let src = folder(
        "fp8",
        &[
            ("model.safetensors", fp8()),
            ("config.json", FP8_CONFIG.into()),
        ],
    );
    let p = plan(&src, "bf16").unwrap();
    assert!(p.dequantize);
    assert_eq!(
        p.configs[0].1.as_deref(),
        Some(r#"{"torch_dtype": "bfloat16"}"#)
    );
    // The weight is written in BF16, its scale dropped.
    assert_eq!(p.planned[0].out_data, 8);
    assert_eq!(p.planned[0].info["tensors_dequantized"], 1);
    std::fs::remove_dir_all(src).unwrap();
}

#[test]
fn fp8_weights_under_a_scheme_stcast_does_not_read_are_refused() {
    let config = r#"{"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}}"#;
    let src = folder(
        "unread",
        &[("model.safetensors", fp8()), ("config.json", config.into())],
    );
    let e = plan(&src, "bf16").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Refused);
    let want = "its quantization_config (quant_method \"modelopt\") is not a scheme stcast \
                dequantizes";
    assert!(e.message().starts_with(want), "{}", e.message());
    std::fs::remove_dir_all(src).unwrap();
}

#[test]
fn a_folder_without_weights_is_refused() {
    let src = folder("empty", &[("config.json", b"{}".to_vec())]);
    let e = plan(&src, "bf16").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Refused);
    assert!(e.message().ends_with("nothing to convert"));
    std::fs::remove_dir_all(src).unwrap();
}

#[test]
fn fp8_weights_without_a_model_config_get_a_side_config() {
    let src = folder(
        "side",
        &[
            ("sub/model.safetensors", f32s(&["l.weight"])),
            ("config.json", b"{}".to_vec()),
        ],
    );
    let p = plan(&src, "fp8").unwrap();
    assert_eq!(
        p.model_config.as_deref(),
        Some(src.join("config.json").as_path())
    );
    let side: Vec<&str> = p
        .configs
        .iter()
        .map(|(f, _)| f.rel.to_str().unwrap())
        .collect();
    assert_eq!(side, ["config.json", "sub/quantization_config.json"]);
    assert_eq!(p.planned[0].unquantized.as_deref(), Some(&[][..]));
    std::fs::remove_dir_all(src).unwrap();
}

#[test]
fn configs_say_which_schemes_they_dequantize() {
    let doc = |t: &'static str| json::parse(t).unwrap();
    let ct = |w: &str, fmt: &str| {
        format!(
            r#"{{"quantization_config": {{"quant_method": "compressed-tensors", "format": {fmt}, "config_groups": {{"g": {{"weights": {w}}}}}}}}}"#
        )
    };
    let int4 = ct(r#"{"type": "int", "num_bits": 4}"#, r#""pack-quantized""#);
    let bad = ct(r#"{"type": "int", "num_bits": 4}"#, r#""int-quantized""#);
    let bits = ct(r#"{"type": "int", "num_bits": 4.5}"#, r#""pack-quantized""#);
    let int4: &'static str = Box::leak(int4.into_boxed_str());
    let bad: &'static str = Box::leak(bad.into_boxed_str());
    let bits: &'static str = Box::leak(bits.into_boxed_str());
    assert!(dequantizes(&doc(int4), Target::Bf16));
    assert!(!dequantizes(&doc(int4), Target::Fp8));
    assert!(dequantizes(&doc(FP8_CONFIG), Target::F16));
    let message = |t| match unread_quantization(&doc(t), Target::Bf16) {
        Some(ConfigProblem::Unread { detail, .. }) => detail,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        message(bad),
        "config group `g` says format \"int-quantized\", which holds int 8-bit weights, with \
         int 4-bit ones"
    );
    assert_eq!(
        message(bits),
        "config group `g` says `num_bits` 4.5, not a whole number"
    );
    assert!(has_quantization(&doc(
        r#"{"text_config": {"compression_config": {}}}"#
    )));
    assert!(!has_quantization(&doc(r#"{"quantization_config": null}"#)));
}

#[test]
fn the_plan_says_why_it_converts_nothing_and_which_files_it_leaves_out() {
    let src = folder(
        "nothing",
        &[
            ("model.safetensors", f32s(&["a.weight"])),
            ("trainer_state.json", b"{}".to_vec()),
        ],
    );
    // F32 to BF16 converts: nothing to refuse.
    let p = plan(&src, "bf16").unwrap();
    assert_eq!(p.nothing_to_convert, None);
    // `keep` converts no tensor of a safetensors folder: the output would be a copy.
    let p = plan(&src, "keep").unwrap();
    let why = p.nothing_to_convert.clone().unwrap();
    assert!(why.starts_with("nothing to convert: the folder's weights are safetensors"));
    assert!(why.ends_with("the output would be a copy of the folder"));
    let left_out = skipped_notes(&p.skipped);
    assert_eq!(left_out.len(), 1);
    assert_eq!(left_out[0].kind, WarningKind::SkippedFiles);
    assert!(left_out[0]
        .text
        .starts_with("left out: training state, not weights (never read): `trainer_state.json`"));
}
