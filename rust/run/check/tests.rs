use super::*;

/// A fresh folder for one test.
fn folder(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("stcast-check-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A safetensors file at `path` holding `tensors` (name, dtype, bytes), zero-filled, each
/// one-dimensional.
fn shard(path: &Path, tensors: &[(&str, &str, u64)]) {
    let width = |dtype: &str| match dtype {
        "F8_E4M3" => 1,
        "F32" => 4,
        _ => 2,
    };
    let shapes: Vec<[usize; 1]> = tensors
        .iter()
        .map(|(_, dtype, n)| [*n as usize / width(dtype)])
        .collect();
    let tensors: Vec<(&str, &str, &[usize])> = tensors
        .iter()
        .zip(&shapes)
        .map(|((name, dtype, _), shape)| (*name, *dtype, &shape[..]))
        .collect();
    crate::run::fp8config::tests::shard(path, &tensors);
}

fn map(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(t, s)| (t.to_string(), s.to_string()))
        .collect()
}

const INDEX: &str = "{\"metadata\": {\"total_size\": 1}, \"weight_map\": {\"a\": \"x.safetensors\", \"b\": \"y.safetensors\"}}";

#[test]
fn an_index_gets_the_total_size_of_the_shards_and_must_agree_with_them() {
    let dst = folder("total");
    shard(&dst.join("x.safetensors"), &[("a", "BF16", 4)]);
    shard(&dst.join("y.safetensors"), &[("b", "BF16", 6)]);
    let wm = map(&[("a", "x.safetensors"), ("b", "y.safetensors")]);
    assert_eq!(index_total(&dst, Path::new("i.json"), &wm).unwrap(), 10);
    let text = written_index(&dst, Path::new("i.json"), INDEX, &wm, Scales::Kept, None).unwrap();
    assert_eq!(
        text,
        INDEX.replace("\"total_size\": 1", "\"total_size\": 10")
    );
    // A tensor the shard does not hold; one the index does not list.
    let wrong = map(&[("a", "x.safetensors"), ("b", "x.safetensors")]);
    let e = index_total(&dst, Path::new("i.json"), &wrong).unwrap_err();
    assert!(e
        .template()
        .contains("lists tensor `b` there, but the file written does not hold it"));
    assert_eq!(e.path(), Some(dst.join("x.safetensors").as_path()));
    assert_eq!(e.kind(), crate::vocab::ErrorKind::InvalidInput);
    let short = map(&[("a", "x.safetensors"), ("c", "y.safetensors")]);
    let e = index_total(&dst, Path::new("i.json"), &short).unwrap_err();
    assert!(
        why(&e).starts_with("the index i.json lists tensor `c`"),
        "{}",
        why(&e)
    );
    shard(
        &dst.join("y.safetensors"),
        &[("b", "BF16", 6), ("c", "BF16", 2)],
    );
    let e = index_total(&dst, Path::new("i.json"), &wm).unwrap_err();
    assert!(why(&e).starts_with("holds tensor `c`, which the index i.json does not list there"));
}

#[test]
fn fp8_scales_are_added_and_a_dequantized_shards_dropped() {
    let dst = folder("scales");
    shard(
        &dst.join("x.safetensors"),
        &[("l.weight", "F8_E4M3", 4), ("l.weight_scale", "F32", 4)],
    );
    shard(&dst.join("y.safetensors"), &[("m.weight", "BF16", 2)]);
    let wm = map(&[("l.weight", "x.safetensors"), ("m.weight", "y.safetensors")]);
    let text =
        "{\"weight_map\": {\"m.weight\": \"y.safetensors\", \"l.weight\": \"x.safetensors\"}}";
    let fp8 = written_index(&dst, Path::new("i.json"), text, &wm, Scales::Added, None).unwrap();
    assert_eq!(
        fp8,
        "{\n  \"weight_map\": {\n    \"l.weight\": \"x.safetensors\",\n    \"l.weight_scale\": \
         \"x.safetensors\",\n    \"m.weight\": \"y.safetensors\"\n  },\n  \"metadata\": {\n    \
         \"total_size\": 10\n  }\n}\n"
    );
    assert!(!dequantized(&dst, &wm));
    // SRC's index lists a scale that DST's shard no longer holds: dequantized.
    shard(&dst.join("x.safetensors"), &[("l.weight", "BF16", 4)]);
    let src = map(&[
        ("l.weight", "x.safetensors"),
        ("l.weight_scale", "x.safetensors"),
    ]);
    assert!(dequantized(&dst, &src));
    let text = "{\"weight_map\": {\"l.weight\": \"x.safetensors\", \"l.weight_scale\": \"x.safetensors\"}}";
    let deq = written_index(&dst, Path::new("i.json"), text, &src, Scales::Dropped, None).unwrap();
    assert!(
        deq.contains("\"total_size\": 4") && !deq.contains("weight_scale"),
        "{deq}"
    );
}

#[test]
fn copies_must_hold_the_same_bytes() {
    let dir = folder("copies");
    std::fs::write(dir.join("a"), b"same").unwrap();
    std::fs::write(dir.join("b"), b"same").unwrap();
    std::fs::write(dir.join("c"), b"sane").unwrap();
    assert!(same_bytes(&dir.join("a"), &dir.join("b")));
    assert!(!same_bytes(&dir.join("a"), &dir.join("c")));
    assert!(!same_bytes(&dir.join("a"), &dir.join("missing")));
    let src = folder("copies-src");
    std::fs::write(src.join("t.json"), b"same").unwrap();
    std::fs::write(src.join("u.json"), b"other").unwrap();
    let c = Companions {
        copies: vec![
            ("a".into(), src.join("t.json")),
            ("c".into(), src.join("t.json")),
        ],
        ..Companions::default()
    };
    let f = check(&dir, None, false, &c).unwrap().unwrap();
    assert_eq!(f.0, "c");
    assert!(f.1.contains("copies must be byte for byte"));
}

#[test]
fn loose_json_is_the_same_data() {
    let same = |a: &str, b: &str| same_json(a.as_bytes(), b.as_bytes(), true);
    assert!(same("{\"a\": 1, \"b\": [true]}", "{\"b\":[true],\"a\":1}"));
    assert!(same("{\"a\": 1, \"a\": 2}", "{\"a\": 2}"));
    assert!(same("[null, \"\\u00e9\"]", "[null,\"é\"]"));
    assert!(!same("{\"a\": 1}", "{\"a\": 1, \"b\": 2}"));
    assert!(!same("[1]", "[\"1\"]"));
    assert!(!same_json(b"{\"a\":1}", b"{\"a\": 1}", false));
}

#[test]
fn an_index_left_beside_the_output_may_not_route_its_tensors_elsewhere() {
    let dst = folder("stray");
    shard(&dst.join("model.safetensors"), &[("a", "BF16", 2)]);
    shard(&dst.join("old-1.safetensors"), &[("a", "BF16", 2)]);
    let stale = "{\"weight_map\": {\"a\": \"old-1.safetensors\"}}";
    std::fs::write(dst.join("old.safetensors.index.json"), stale).unwrap();
    let c = Companions {
        stray: vec!["old.safetensors.index.json".into()],
        output: vec!["model.safetensors".into()],
        ..Companions::default()
    };
    let f = check(&dst, None, true, &c).unwrap().unwrap();
    assert_eq!(f.0, "old.safetensors.index.json");
    assert!(
        f.1.starts_with(
            "places tensor `a` in `old-1.safetensors`, while the verified output holds it in \
             `model.safetensors`"
        ),
        "{}",
        f.1
    );
    // An index naming what it should passes; one naming a missing or odd file does not.
    let good = "{\"weight_map\": {\"a\": \"model.safetensors\"}}";
    std::fs::write(dst.join("old.safetensors.index.json"), good).unwrap();
    assert_eq!(check(&dst, None, true, &c).unwrap(), None);
    for (text, why) in [
        (
            "{\"weight_map\": {\"a\": \"gone.safetensors\"}}",
            "names shard `gone.safetensors`, which is missing",
        ),
        (
            "{\"weight_map\": {\"a\": \"../x\"}}",
            "weight_map entry `a` names '../x': shard names",
        ),
        (
            "{\"weight_map\": {\"a\": 5}}",
            "weight_map entry `a` names 5: shard names",
        ),
        ("{\"weight_map\": {}}", "its weight_map is empty"),
        (
            "{\"weight_map\": 3}",
            "not a safetensors index (no weight_map object)",
        ),
        (
            "{\"weight_map\": {\"a\": \"model.safetensors\"}, \"metadata\": []}",
            "`metadata` is not an object",
        ),
        ("{", "not valid JSON"),
        ("\u{ff}", "not valid JSON"),
        (
            &format!("{}1{}", "[".repeat(150), "]".repeat(150)),
            "JSON nested deeper than 100",
        ),
    ] {
        std::fs::write(dst.join("old.safetensors.index.json"), text).unwrap();
        let f = check(&dst, None, true, &c).unwrap().unwrap();
        let want = format!("an index DST holds beside the output: {why}");
        assert!(f.1.starts_with(&want), "{} / {want}", f.1);
    }
}

#[test]
fn an_index_in_dst_is_checked_against_what_convert_writes() {
    let dst = folder("indexes");
    shard(&dst.join("x.safetensors"), &[("a", "BF16", 4)]);
    shard(&dst.join("y.safetensors"), &[("b", "BF16", 6)]);
    let wm = map(&[("a", "x.safetensors"), ("b", "y.safetensors")]);
    let want = INDEX.replace("\"total_size\": 1", "\"total_size\": 10");
    std::fs::write(dst.join("i.json"), &want).unwrap();
    let c = Companions {
        indexes: vec![("i.json".into(), INDEX.into(), wm)],
        ..Companions::default()
    };
    assert_eq!(check(&dst, None, false, &c).unwrap(), None);
    // Another layout: only loose takes it.
    let relaid = want.replace(": ", ":");
    std::fs::write(dst.join("i.json"), relaid).unwrap();
    let f = check(&dst, None, false, &c).unwrap().unwrap();
    assert_eq!(
        f.1,
        "is not SRC's index with the total size of DST's shards"
    );
    assert_eq!(check(&dst, None, true, &c).unwrap(), None);
    // A shard that does not hold what the index says: named in the finding.
    shard(&dst.join("y.safetensors"), &[("c", "BF16", 6)]);
    let f = check(&dst, None, true, &c).unwrap().unwrap();
    assert!(
        f.1.contains("y.safetensors: the index i.json lists tensor `b`"),
        "{}",
        f.1
    );
}

#[test]
fn a_pytorch_index_gets_its_shards_safetensors_names() {
    let dir = folder("torch");
    let text = "{\"weight_map\": {\"a\": \"pytorch_model-00001-of-00002.bin\"}}";
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    std::fs::write(dir.join("sub/i.json"), text).unwrap();
    let found: HashSet<PathBuf> = [PathBuf::from("sub/model-00001-of-00002.safetensors")].into();
    let (got, map) = read_index(
        &dir.join("sub/i.json"),
        Path::new("sub/i.json"),
        true,
        &found,
        &[],
    )
    .unwrap();
    assert_eq!(
        got,
        text.replace("pytorch_model", "model")
            .replace(".bin", ".safetensors")
    );
    assert_eq!(
        map,
        [("a".into(), "sub/model-00001-of-00002.safetensors".into())]
    );
    let e = read_index(
        &dir.join("sub/i.json"),
        Path::new("sub/i.json"),
        false,
        &found,
        &[],
    )
    .unwrap_err();
    assert!(why(&e).starts_with("names shard `pytorch_model-00001-of-00002.bin`, which is missing"));
    let odd = "{\"weight_map\": {\"a\": \"weights.bin\"}}";
    std::fs::write(dir.join("sub/i.json"), odd).unwrap();
    let e = read_index(
        &dir.join("sub/i.json"),
        Path::new("sub/i.json"),
        true,
        &found,
        &[],
    )
    .unwrap_err();
    assert!(
        why(&e).contains("which is not a PyTorch weight file"),
        "{}",
        why(&e)
    );
    std::fs::write(
        dir.join("sub/i.json"),
        "{\"weight_map\": {\"a\": \"/etc/x\"}}",
    )
    .unwrap();
    let e = read_index(
        &dir.join("sub/i.json"),
        Path::new("sub/i.json"),
        false,
        &found,
        &[],
    )
    .unwrap_err();
    assert_eq!(e.kind(), crate::vocab::ErrorKind::Refused);
}

#[test]
fn an_index_loses_the_prefixes_its_tensors_lose() {
    let dir = folder("strip");
    let text = "{\n  \"metadata\": {\n    \"total_size\": 8\n  },\n  \"weight_map\": {\n    \
                \"module._orig_mod.b\": \"m-2.safetensors\",\n    \
                \"module._orig_mod.a\": \"m-1.safetensors\",\n    \"c\": \"m-1.safetensors\"\n  }\n}\n";
    std::fs::write(dir.join("i.json"), text).unwrap();
    let found: HashSet<PathBuf> = ["m-1.safetensors", "m-2.safetensors"]
        .map(PathBuf::from)
        .into();
    let both = ["module.".to_string(), "_orig_mod.".to_string()];
    let read = |prefixes: &[String]| {
        read_index(
            &dir.join("i.json"),
            Path::new("i.json"),
            false,
            &found,
            prefixes,
        )
    };
    // In turn, each from what the one before left; the text in its own style (json.dumps
    // with indent 2, as save_pretrained writes it) and order.
    let (got, map) = read(&both).unwrap();
    assert_eq!(got, text.replace("module._orig_mod.", ""));
    let names: Vec<&str> = map.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["b", "a", "c"]);
    // A prefix that drops nothing leaves the text as it was.
    assert_eq!(read(&["x.".to_string()]).unwrap().0, text);
    // Two names that would be one: refused, naming both, before any shard is read.
    let clash = text.replace("\"c\"", "\"_orig_mod.a\"");
    std::fs::write(dir.join("i.json"), &clash).unwrap();
    let e = read(&both).unwrap_err();
    assert_eq!(
        why(&e),
        "tensors `module._orig_mod.a` and `_orig_mod.a` would both be named `a`"
    );
    assert_eq!(e.kind(), crate::vocab::ErrorKind::InvalidInput);
}

#[test]
fn a_config_must_be_the_text_convert_writes_or_loosely_its_data() {
    let dst = folder("configs");
    std::fs::write(dst.join("config.json"), "{\"dtype\":\"bfloat16\"}").unwrap();
    let src = "{\"dtype\": \"float32\"}".to_string();
    let c = Companions {
        configs: vec![("config.json".into(), src, false, None)],
        ..Companions::default()
    };
    let f = check(&dst, None, false, &c).unwrap().unwrap();
    assert_eq!(f, ("config.json".into(), CONFIG_DIFFERS.into()));
    assert_eq!(check(&dst, None, true, &c).unwrap(), None);
    std::fs::remove_file(dst.join("config.json")).unwrap();
    let f = check(&dst, None, true, &c).unwrap().unwrap();
    assert!(f.1.contains("config.json: cannot open"), "{}", f.1);
    // A source convert refuses for its config: named first.
    let why = "its quantization_config (quant_method \"awq\") is not a scheme".to_string();
    let c = Companions {
        configs: vec![("config.json".into(), "{}".into(), false, Some(why))],
        ..Companions::default()
    };
    let f = check(&dst, None, true, &c).unwrap().unwrap();
    assert_eq!(
        f.1,
        "in SRC: its quantization_config (quant_method \"awq\") is not a scheme"
    );
}

/// An FP8 output's folder: its shard (`fp8config::tests::fp8_shard`), its model config as
/// convert writes it for SRC's `src`, a copy of SRC's `notes.txt`.
fn fp8_output(tag: &str, src: &str) -> (PathBuf, PathBuf) {
    let (dst, from) = (folder(tag), folder(&format!("{tag}-src")));
    crate::run::fp8config::tests::fp8_shard(&dst.join("model.safetensors"));
    let ignore = ["lm_head".to_string()];
    let text = json::config_text(src, Target::Fp8, false, Some(&ignore));
    std::fs::write(dst.join("config.json"), text.unwrap().unwrap()).unwrap();
    std::fs::write(from.join("notes.txt"), b"notes").unwrap();
    std::fs::write(dst.join("notes.txt"), b"notes").unwrap();
    (dst, from)
}

#[test]
fn an_fp8_output_s_companions_match_what_convert_writes() {
    let src = "{\"model_type\": \"llama\", \"torch_dtype\": \"float32\"}";
    let (dst, from) = fp8_output("fp8-good", src);
    let c = Companions {
        copies: vec![("notes.txt".into(), from.join("notes.txt"))],
        configs: vec![("config.json".into(), src.into(), false, None)],
        ..Companions::default()
    };
    let fp8 = Some(Target::Fp8);
    for loose in [false, true] {
        assert_eq!(check(&dst, fp8, loose, &c).unwrap(), None);
    }
    // The config's `ignore` misses the unquantized `lm_head`: strict and loose alike.
    let text = json::config_text(src, Target::Fp8, false, Some(&[]))
        .unwrap()
        .unwrap();
    std::fs::write(dst.join("config.json"), text).unwrap();
    for loose in [false, true] {
        let f = check(&dst, fp8, loose, &c).unwrap().unwrap();
        assert_eq!(f.0, "config.json");
        assert!(
            f.1.starts_with(
                "does not describe the FP8 tensors beside it: `lm_head.weight` is not quantized"
            ),
            "{}",
            f.1
        );
    }
    // A tampered copy is found first.
    std::fs::write(dst.join("notes.txt"), b"notez").unwrap();
    let f = check(&dst, fp8, true, &c).unwrap().unwrap();
    assert_eq!(
        f,
        (
            "notes.txt".into(),
            "differs from the file in SRC (copies must be byte for byte)".into()
        )
    );
}

#[test]
fn a_model_config_added_beside_fp8_shards_must_describe_them() {
    let dst = folder("fp8-added");
    crate::run::fp8config::tests::fp8_shard(&dst.join("model.safetensors"));
    std::fs::write(dst.join("config.json"), "{\"model_type\": \"llama\"}").unwrap();
    let c = Companions {
        added: vec!["config.json".into()],
        ..Companions::default()
    };
    let f = check(&dst, Some(Target::Fp8), true, &c).unwrap().unwrap();
    assert_eq!(
        f,
        (
            "config.json".into(),
            "does not describe the FP8 tensors beside it: has no compressed-tensors \
             quantization_config"
                .into()
        )
    );
    // Not an FP8 output: not checked here; no JSON object: no model config.
    assert_eq!(check(&dst, Some(Target::Bf16), true, &c).unwrap(), None);
    std::fs::write(dst.join("config.json"), "[1]").unwrap();
    assert_eq!(check(&dst, Some(Target::Fp8), true, &c).unwrap(), None);
    // One that describes them passes.
    let ignore = ["lm_head".to_string()];
    let text = json::config_text("{}", Target::Fp8, false, Some(&ignore));
    std::fs::write(dst.join("config.json"), text.unwrap().unwrap()).unwrap();
    assert_eq!(check(&dst, Some(Target::Fp8), true, &c).unwrap(), None);
}

#[test]
fn a_side_quantization_config_is_the_one_of_the_shards_beside_it() {
    let dst = folder("fp8-side");
    crate::run::fp8config::tests::fp8_shard(&dst.join("model.safetensors"));
    let ignore = ["lm_head".to_string()];
    let text = json::config_text("{}", Target::Fp8, false, Some(&ignore));
    std::fs::write(dst.join("quantization_config.json"), text.unwrap().unwrap()).unwrap();
    let c = Companions {
        sides: vec!["quantization_config.json".into()],
        ..Companions::default()
    };
    assert_eq!(check(&dst, Some(Target::Fp8), false, &c).unwrap(), None);
    let f = check(&dst, Some(Target::Fp8Block), false, &c)
        .unwrap()
        .unwrap();
    assert_eq!(
        f.1,
        "is not the quantization_config of the FP8 shards beside it"
    );
    let f = check(&dst, None, false, &c).unwrap().unwrap();
    assert_eq!(
        f.1,
        "is an FP8 quantization_config, beside shards not quantized"
    );
}

#[test]
fn strict_fails_an_fp8_side_config_convert_wrote_that_is_gone() {
    // Attack z11 r4: the only description of the FP8 shards beside it, removed.
    let dst = folder("side-gone");
    crate::run::fp8config::tests::fp8_shard(&dst.join("model.safetensors"));
    let c = Companions {
        sides: vec!["quantization_config.json".into()],
        ..Companions::default()
    };
    let f = check(&dst, Some(Target::Fp8), false, &c).unwrap().unwrap();
    assert_eq!(f.0, "quantization_config.json");
    assert!(f.1.contains("but not in DST"), "{}", f.1);
    // Loose, a dense target, or a model config describing them there: none is wanted.
    assert_eq!(check(&dst, Some(Target::Fp8), true, &c).unwrap(), None);
    assert_eq!(check(&dst, Some(Target::Bf16), false, &c).unwrap(), None);
    std::fs::write(dst.join("config.json"), b"{}").unwrap();
    assert_eq!(check(&dst, Some(Target::Fp8), false, &c).unwrap(), None);
}
