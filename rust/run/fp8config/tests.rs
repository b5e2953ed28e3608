use super::*;
use std::path::PathBuf;

/// A fresh folder for one test.
pub(crate) fn folder(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("stcast-fp8config-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A safetensors file at `path` holding `tensors` (name, dtype, shape), zero-filled.
pub(crate) fn shard(path: &Path, tensors: &[(&str, &str, &[usize])]) {
    let mut entries = Vec::new();
    let mut at = 0;
    for (name, dtype, shape) in tensors {
        let width = match *dtype {
            "F8_E4M3" => 1,
            "F32" => 4,
            _ => 2,
        };
        let n = shape.iter().product::<usize>() * width;
        entries.push(format!(
            "\"{name}\":{{\"dtype\":\"{dtype}\",\"shape\":{shape:?},\"data_offsets\":[{at},{}]}}",
            at + n
        ));
        at += n;
    }
    let mut header = format!("{{{}}}", entries.join(",")).into_bytes();
    while header.len() % 8 != 0 {
        header.push(b' ');
    }
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header);
    bytes.resize(bytes.len() + at, 0);
    std::fs::write(path, bytes).unwrap();
}

/// An FP8 (per channel) output's shard: `a` quantized, `lm_head` and `norm` not.
pub(crate) fn fp8_shard(path: &Path) {
    shard(
        path,
        &[
            ("a.weight", "F8_E4M3", &[4, 8]),
            ("a.weight_scale", "F32", &[4, 1]),
            ("lm_head.weight", "BF16", &[4, 8]),
            ("norm.weight", "BF16", &[8]),
        ],
    );
}

/// The config stcast writes for `target`, `ignore` the modules given.
fn ours(target: Target, ignore: &[&str]) -> String {
    let ignore: Vec<String> = ignore.iter().map(|m| m.to_string()).collect();
    let text = config_text("{\"model_type\": \"llama\"}", target, false, Some(&ignore));
    text.unwrap().unwrap()
}

fn problem_of(text: &str, target: Target, m: &Modules) -> Option<String> {
    let doc: Value = serde_json::from_str(text).unwrap();
    problem(doc.get("quantization_config"), target, m).map(|p| p.to_string())
}

#[test]
fn the_modules_beside_a_config_are_read_from_the_shards() {
    let dir = folder("modules");
    fp8_shard(&dir.join("model.safetensors"));
    std::fs::write(dir.join("notes.safetensors.txt"), b"not weights").unwrap();
    let m = Modules::beside(&dir, Path::new("config.json")).unwrap();
    assert_eq!(
        m.quantized.into_iter().collect::<Vec<_>>(),
        [("a".to_string(), (vec![4, 8], vec![4, 1]))]
    );
    assert_eq!(m.unquantized, ["lm_head"]);
}

#[test]
fn a_good_fp8_config_describes_its_tensors() {
    let dir = folder("good");
    fp8_shard(&dir.join("model.safetensors"));
    let m = Modules::beside(&dir, Path::new("config.json")).unwrap();
    let text = ours(Target::Fp8, &["lm_head"]);
    assert_eq!(problem_of(&text, Target::Fp8, &m), None);
    // Another layout, the inert keys dropped or null, `ignore` by pattern: the same.
    let doc: Value = serde_json::from_str(&text).unwrap();
    let mut other = doc.clone();
    let q = other["quantization_config"].as_object_mut().unwrap();
    q.insert("ignore".into(), serde_json::json!(["re:lm_.*"]));
    q.insert("version".into(), serde_json::json!("0.19.0"));
    let w = q["config_groups"]["FP8_DYNAMIC"]["weights"]
        .as_object_mut()
        .unwrap();
    w.insert("observer".into(), serde_json::json!("minmax"));
    w.insert("zp_dtype".into(), Value::Null);
    let src = serde_json::json!({"model_type": "llama", "torch_dtype": "float32"});
    other["torch_dtype"] = "bfloat16".into();
    let other = other.to_string();
    assert_eq!(problem_of(&other, Target::Fp8, &m), None);
    assert_eq!(
        same_config(other.as_bytes(), &src.to_string(), Target::Fp8, &m),
        None
    );
    // SRC's other keys must stay.
    let src = serde_json::json!({"model_type": "mistral"}).to_string();
    assert_eq!(
        same_config(other.as_bytes(), &src, Target::Fp8, &m),
        Some(Problem::OtherKeys)
    );
    assert_eq!(
        same_config(b"{", "{}", Target::Fp8, &m),
        Some(Problem::NotJson)
    );
    // Its dtype SRC's or the target's (nested configs' too), not another (attack a3 F4).
    let src = serde_json::json!({"model_type": "llama", "torch_dtype": "float32",
                                 "text_config": {"dtype": "float32"}});
    let mut other: Value = serde_json::from_str(&other).unwrap();
    for (dtype, nested, want) in [
        ("float32", "float32", None),
        ("bfloat16", "bfloat16", None),
        (
            "float16",
            "float32",
            Some(Problem::Dtype {
                target: Target::Fp8,
            }),
        ),
        ("bfloat16", "float16", Some(Problem::OtherKeys)),
    ] {
        other["model_type"] = "llama".into();
        other["torch_dtype"] = dtype.into();
        other["text_config"] = serde_json::json!({ "dtype": nested });
        let got = same_config(
            other.to_string().as_bytes(),
            &src.to_string(),
            Target::Fp8,
            &m,
        );
        assert_eq!(got, want, "{dtype} {nested}");
    }
    // SRC's `compression_config` is dropped, not kept beside the quantization_config: a
    // config holding both is two descriptions of the weights (attack z11 r20).
    let src = serde_json::json!({"model_type": "llama", "compression_config": {"format": "x"}});
    assert_eq!(
        same_config(text.as_bytes(), &src.to_string(), Target::Fp8, &m),
        None
    );
    let mut two = doc.clone();
    two["compression_config"] = src["compression_config"].clone();
    let two = two.to_string();
    let want = Some(Problem::TwoDescriptions {
        key: "compression_config",
    });
    assert_eq!(
        same_config(two.as_bytes(), &src.to_string(), Target::Fp8, &m),
        want
    );
    // A module stcast names by an anchored pattern (`re:Norm\Z`, Python's end of string).
    let caps = Modules {
        unquantized: vec!["Norm".into()],
        ..m.clone()
    };
    let text = ours(Target::Fp8, &["Norm"]);
    assert!(text.contains("re:Norm\\\\Z"), "{text}");
    assert_eq!(problem_of(&text, Target::Fp8, &caps), None);
    let text = ours(Target::Fp8, &["Normal"]);
    assert!(problem_of(&text, Target::Fp8, &caps)
        .unwrap()
        .contains("`Norm`"));
    // The strategy names the target.
    assert_eq!(strategy_target(text.as_bytes()), Some(Target::Fp8));
    let block = ours(Target::Fp8Block, &[]);
    assert_eq!(strategy_target(block.as_bytes()), Some(Target::Fp8Block));
    assert_eq!(strategy_target(b"{\"quantization_config\": 1}"), None);
    assert_eq!(strategy_target(b"[]"), None);
}

#[test]
fn a_config_that_misdescribes_its_tensors_says_what() {
    let dir = folder("bad");
    fp8_shard(&dir.join("model.safetensors"));
    let m = Modules::beside(&dir, Path::new("config.json")).unwrap();
    // `ignore` misses the unquantized `lm_head`.
    let text = ours(Target::Fp8, &[]);
    assert_eq!(
        problem_of(&text, Target::Fp8, &m).unwrap(),
        "`lm_head.weight` is not quantized, but `ignore` does not name `lm_head` (a loader \
         would read it as FP8 with a made-up scale)"
    );
    // `ignore` names the quantized `a`.
    let text = ours(Target::Fp8, &["lm_head", "a"]);
    assert_eq!(
        problem_of(&text, Target::Fp8, &m).unwrap(),
        "`ignore` entry `a` names `a`, whose weight is quantized (a loader would read its \
         FP8 codes as weights)"
    );
    // Block strategy over per-channel scales; its scheme differs first.
    let text = ours(Target::Fp8Block, &["lm_head"]);
    assert_eq!(
        problem_of(&text, Target::Fp8, &m).unwrap(),
        "config group `FP8_BLOCK` `weights.block_structure` is [128, 128], not null as in \
         {{to=fp8}}'s tensors"
    );
    let text = ours(Target::Fp8, &["lm_head"]);
    assert_eq!(
        problem_of(&text, Target::Fp8Block, &m).unwrap(),
        "config group `FP8_DYNAMIC` `weights.block_structure` is null, not [128, 128] as in \
         {{to=fp8-block}}'s tensors"
    );
    let doc = |q: &str| format!("{{\"quantization_config\": {q}}}");
    for (q, why) in [
        ("null", "has no compressed-tensors quantization_config"),
        (
            "{\"quant_method\": \"fp8\"}",
            "has no compressed-tensors quantization_config",
        ),
        (
            "{\"quant_method\": \"compressed-tensors\", \"format\": \"dense\"}",
            "quantization_config `format` is \"dense\", not \"float-quantized\"",
        ),
        (
            "{\"quant_method\": \"compressed-tensors\", \"format\": \"float-quantized\", \
             \"quantization_status\": \"compressed\", \"kv_cache_scheme\": {\"a\": 1}}",
            "quantization_config `kv_cache_scheme` is set, but the tensors hold none",
        ),
        (
            "{\"quant_method\": \"compressed-tensors\", \"format\": \"float-quantized\", \
             \"quantization_status\": \"compressed\", \"config_groups\": {}}",
            "quantization_config has no config_groups",
        ),
    ] {
        assert_eq!(problem_of(&doc(q), Target::Fp8, &m).unwrap(), why);
    }
    // A pattern stcast cannot match as Python's `re` does.
    let text = ours(Target::Fp8, &["lm_head"]).replace("\"lm_head\"", "\"re:(\"");
    let why = problem_of(&text, Target::Fp8, &m).unwrap();
    assert!(
        why.starts_with("quantization_config pattern `re:(` is not a regex ("),
        "{why}"
    );
}
