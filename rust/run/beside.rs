//! The files beside a lone checkpoint's output (a file, or a DCP, ZeRO or single-file source
//! written into a folder): the model config `config.json` a loader reads with it, an FP8
//! output's `<stem>.quantization_config.json`, and an earlier re-sharding's shards and index
//! under the output's stem. What each must say of the weights beside it: `convert` refuses
//! (or withdraws) one that would describe its output wrongly, `verify` fails one that does.

use std::ffi::OsString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::header::SourceHeader;
pub use crate::run::fp8config::Modules;
use crate::run::fp8config::{config_problem, quantization_config, two_descriptions};
use crate::run::json::QUANTIZATION_KEYS;
use crate::text::{esc, esc_path};
use crate::vocab::{is_quantized_dtype, Target};

/// Where a lone FP8 output's `quantization_config` goes: `<stem>.quantization_config.json`
/// beside it (`out.safetensors` -> `out.quantization_config.json`).
pub fn side_config_path(dst: &Path) -> PathBuf {
    use std::os::unix::ffi::OsStrExt;
    let name = dst.file_name().unwrap_or_default().as_bytes();
    let stem = name.strip_suffix(b".safetensors").unwrap_or(name);
    let name = [stem, b".quantization_config.json"].concat();
    dst.with_file_name(std::ffi::OsStr::from_bytes(&name))
}

/// Where a folder run puts the `quantization_config` of FP8 weights no model config
/// describes, in their folder (python/stcast/folder/fp8.py `SIDE_CONFIG_NAME`, which
/// writes it).
pub const FOLDER_SIDE_CONFIG: &str = "quantization_config.json";

/// What the weights of a lone output are, as a config beside them must describe them.
#[derive(Debug, Clone, Copy)]
pub enum Weights<'a> {
    /// Not quantized (a bf16 or fp16 target): no config may say they are.
    Dense,
    /// An FP8 target's: the config's `quantization_config` must be the one stcast writes
    /// for `target`, and name the modules as `modules` holds them (None: not written yet,
    /// not compared).
    Fp8 {
        target: Target,
        modules: Option<&'a Modules>,
    },
}

/// Refuse the config `path` that a run leaves as it is when it would describe the `weights`
/// written beside it wrongly (`problem`). `folder`: the run writes no config there.
pub fn refuse_wrong_config(path: PathBuf, weights: Weights<'_>, folder: bool) -> Result<()> {
    // (One that is no model config is no text to judge: `problem` of "".)
    let text = crate::run::json::read_model_config(&path).unwrap_or_default();
    match problem(&text, weights, false) {
        Some(why) => Err(Error::WrongConfig { path, why, folder }),
        None => Ok(()),
    }
}

/// What a run that does not write the FP8 side config `path` again (a dense run over an
/// earlier FP8 output) does with it.
#[derive(Debug, PartialEq, Eq)]
pub enum StaleSide {
    /// Exactly the one stcast writes beside `weights` (the earlier output's, under either
    /// FP8 target): proof that stcast wrote it, withdrawn.
    Withdraw,
    /// Not stcast's, and it would describe the new weights wrongly (`problem`): the run is
    /// refused before it writes.
    Refuse(String),
    /// Not stcast's, and saying nothing of them (not JSON): left as it is.
    Leave,
}

/// `StaleSide` of the side config `path`, beside the weight files `weights` (the
/// output's, as they are before the run replaces them), under the run's `target`.
pub fn stale_side(path: &Path, weights: &[PathBuf], target: Target) -> StaleSide {
    let text = crate::run::json::read_model_config(path).unwrap_or_default();
    let modules = Modules::of_files(weights).ok();
    let ours = !weights.is_empty()
        && modules.as_ref().is_some_and(|modules| {
            [Target::Fp8, Target::Fp8Block].into_iter().any(|target| {
                let old = Weights::Fp8 {
                    target,
                    modules: Some(modules),
                };
                problem(&text, old, true).is_none()
            })
        });
    match (ours, Weights::planned(target)) {
        (true, _) => StaleSide::Withdraw,
        (false, Some(new)) => {
            problem(&text, new, false).map_or(StaleSide::Leave, StaleSide::Refuse)
        }
        (false, None) => StaleSide::Leave,
    }
}

impl Weights<'_> {
    /// The weights of a run's output under `target`, before they are written; None when no
    /// config says anything of them (`keep`: the input's own dtypes).
    pub fn planned(target: Target) -> Option<Weights<'static>> {
        match (target.strategy(), target) {
            (Some(_), _) => Some(Weights::Fp8 {
                target,
                modules: None,
            }),
            (None, Target::Keep) => None,
            (None, _) => Some(Weights::Dense),
        }
    }

    /// Does a dense output's config lose its quantization keys?
    pub fn dense(target: Target) -> bool {
        matches!(Weights::planned(target), Some(Weights::Dense))
    }
}

/// The model config a loader reads with the lone output `dst`: `config.json` in its folder,
/// when it is there and `dst` is the folder's only weights, or is `model.safetensors` (the
/// file transformers loads with that config, whatever else the folder holds); otherwise the
/// config is another checkpoint's, or says nothing a loader of `dst` would read.
pub fn model_config(dst: &Path) -> Option<PathBuf> {
    let dir = crate::output::parent_dir(dst);
    let config = dir.join("config.json");
    if !config.is_file() {
        return None;
    }
    let name = dst.file_name()?;
    if name == "model.safetensors" {
        return Some(config);
    }
    let others = std::fs::read_dir(&dir)
        .ok()?
        .filter_map(|e| e.ok())
        .any(|e| {
            let n = e.file_name();
            n != name && n.as_bytes().ends_with(b".safetensors")
        });
    (!others).then_some(config)
}

/// What is wrong with the config text `text` beside `weights`: None if it describes them.
/// `exact`: an FP8 output's `quantization_config` must be the one stcast writes (its
/// `ignore` in any order); otherwise (another tool's, or one judged before the weights are
/// written) its method, format and each group's weights, and the modules it names.
pub fn problem(text: &str, weights: Weights<'_>, exact: bool) -> Option<String> {
    let Ok(Value::Object(doc)) = serde_json::from_str(text) else {
        // One that is no JSON object says nothing of dense weights.
        return matches!(weights, Weights::Fp8 { .. }).then(|| "is not a JSON object".into());
    };
    let (target, modules) = match weights {
        Weights::Dense => {
            let set = |k: &&&str| doc.get(**k).is_some_and(|v| !v.is_null());
            return QUANTIZATION_KEYS
                .iter()
                .find(set)
                .map(|k| format!("has a `{k}`, while the weights beside it are not quantized"));
        }
        Weights::Fp8 { target, modules } => (target, modules),
    };
    if !exact {
        // Loose: the one rule of an FP8 config and the modules beside it
        // (`fp8config::config_problem`), a folder's and a lone output's alike.
        let empty = Modules::default();
        let problem = config_problem(&doc, target, modules.unwrap_or(&empty));
        return problem.map(|p| p.to_string());
    }
    if let Some(p) = two_descriptions(&doc) {
        return Some(p.to_string());
    }
    let none = || Some("has no compressed-tensors quantization_config".to_string());
    let Some(Value::Object(got)) = doc.get("quantization_config") else {
        return none();
    };
    let ignore = modules.map_or(&[][..], |m| &m.unquantized[..]);
    let mut want = quantization_config(target, ignore);
    if got.get("quant_method") != want.get("quant_method") {
        return none();
    }
    let mut got = got.clone();
    let as_set = |m: &mut Map<String, Value>| {
        if let Some(Value::Array(a)) = m.get_mut("ignore") {
            a.sort_by_key(|v| v.to_string());
        }
    };
    as_set(&mut got);
    as_set(&mut want);
    if modules.is_none() {
        got.remove("ignore");
        want.remove("ignore");
    }
    let keys = want.keys().chain(got.keys());
    let k = keys.into_iter().find(|k| want.get(*k) != got.get(*k))?;
    Some(format!(
        "its quantization_config's `{}` is not the one of the FP8 weights beside it",
        esc(k)
    ))
}

/// What the lone output whose header is `header`, written for `to`, holds (`Weights`), its
/// modules in `modules`. None: no config describes it (`keep`, or quantized tensors a
/// dense target copied).
pub fn written<'a>(
    header: &SourceHeader,
    to: Option<Target>,
    modules: &'a mut Modules,
) -> Option<Weights<'a>> {
    match Weights::planned(to?)? {
        Weights::Dense => {
            let quantized = header.tensors.iter().any(|t| is_quantized_dtype(t.dtype));
            (!quantized).then_some(Weights::Dense)
        }
        Weights::Fp8 { target, .. } => {
            *modules = Modules::of(header);
            Some(Weights::Fp8 {
                target,
                modules: Some(modules),
            })
        }
    }
}

/// The FP8 target the config describing the lone output `dst` says its weights have
/// (`fp8config::strategy_target`): its model config (`model_config`), else its side config
/// (`side_config_path`). None when neither says one. For an output that records no target,
/// as `check::configured` is a folder's.
pub fn configured(dst: &Path) -> Option<Target> {
    let side = side_config_path(dst);
    model_config(dst)
        .into_iter()
        .chain([side])
        .find_map(|path| {
            let text = crate::run::json::read_model_config(&path).ok()?;
            crate::run::fp8config::strategy_target(text.as_bytes())
        })
}

/// Is the FP8 output `dst` described where the run that wrote it put its
/// quantization_config: its side config (`side_config_path`, a lone file's run), or in its
/// folder a side config (`FOLDER_SIDE_CONFIG`) or a model config with a quantization key (a
/// folder's run, of which `dst` may be one file)? Every FP8 run writes one of them.
fn described(dst: &Path) -> bool {
    let dir = crate::output::parent_dir(dst);
    let quantized = |path: PathBuf| {
        let text = crate::run::json::read_model_config(&path).unwrap_or_default();
        let doc = serde_json::from_str::<Value>(&text).unwrap_or_default();
        QUANTIZATION_KEYS.iter().any(|k| doc.get(*k).is_some())
    };
    side_config_path(dst).is_file()
        || dir.join(FOLDER_SIDE_CONFIG).is_file()
        || quantized(dir.join("config.json"))
}

/// The first file beside the lone output `dst` (whose header is `header`, written for
/// `to`) that would mislead a loader of it: an earlier re-sharding's index or shards under
/// its stem (`leftovers`), a config that does not describe its weights (`wrong_config`), in
/// strict mode an FP8 output's quantization_config that is nowhere convert writes it
/// (`described`: the output's record says the target, so it was written), or the model config a `--config` run wrote beside it when DST's record says so (`given`:
/// `given_config`). Returns the message (a template naming the file), or None.
pub fn check(
    dst: &Path,
    header: &SourceHeader,
    to: Option<Target>,
    exact: bool,
    given: bool,
) -> Option<String> {
    let dir = crate::output::parent_dir(dst);
    if let Some(first) = leftovers(dst).first() {
        return Some(format!(
            "{}: is named as an index or shard of {}, beside it: a loader reads it for the \
             output (an earlier run's, which this output did not replace)",
            esc_path(&dir.join(first)),
            esc_path(dst.file_name().map(Path::new).unwrap_or(dst)),
        ));
    }
    let mut modules = Modules::default();
    if let Some(weights) = written(header, to, &mut modules) {
        let strict = to.filter(|_| exact);
        if let Some((path, why)) = wrong_config(dst, weights, strict) {
            return Some(format!(
                "{}: does not describe the weights beside it: {why}",
                esc_path(&path)
            ));
        }
    }
    let fp8 = to.is_some_and(|t| t.strategy().is_some());
    if exact && fp8 && !given && !described(dst) {
        return Some(format!(
            "{}: is missing: convert writes the quantization_config of an FP8 output beside \
             it (a loader reads its weights as FP8 by it)",
            esc_path(&side_config_path(dst))
        ));
    }
    given_config(dst, to.filter(|_| given)?, exact)
}

/// What is wrong with the model config a `--config` run wrote beside the lone output `dst`
/// for `to` (`config.json` in its folder, which must be there): it must be what the run
/// writes of a config (`json::written_config`), judged as a folder's config is
/// (`json::same_json`: `exact`, the bytes; else the same JSON data; under an FP8 target
/// loose mode leaves its quantization to `wrong_config`, as a folder's FP8 config). What the
/// given config said is not known: the config is its own source, its dtype keys set to the
/// target's (its quantization keys are `wrong_config`'s).
fn given_config(dst: &Path, to: Target, exact: bool) -> Option<String> {
    let path = crate::output::parent_dir(dst).join("config.json");
    let at = esc_path(&path);
    let got = match crate::run::json::read_model_config(&path) {
        Ok(got) => got,
        Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            return Some(format!(
                "{at}: is missing: DST's record says convert wrote it beside the output \
                 (--config)"
            ));
        }
        Err(e) => return Some(e.template()),
    };
    let want = crate::run::json::written_config(&got, to, false, None);
    let same = match want {
        // Loose under FP8: its quantization is `wrong_config`'s (another tool's may describe
        // the weights too), the rest the same data, its dtype the target's (attack a3 F4).
        Ok(want) if !exact && to.strategy().is_some() => {
            let data = |t: &str| {
                let mut doc = serde_json::from_str::<Map<String, Value>>(t).ok()?;
                doc.retain(|k, _| !QUANTIZATION_KEYS.contains(&k.as_str()));
                Some(doc)
            };
            data(&got) == data(&want)
        }
        Ok(want) => crate::run::json::same_json(got.as_bytes(), want.as_bytes(), !exact),
        Err(_) => false,
    };
    (!same).then(|| format!("{at}: {GIVEN_CONFIG_DIFFERS}"))
}

/// How `given_config` says the model config beside a lone output is not one convert wrote.
const GIVEN_CONFIG_DIFFERS: &str =
    "is not the config given to convert (--config) with the dtype set to the target";

/// The first config beside the lone output `dst` that does not describe `weights`: the
/// model config (`model_config`) and the FP8 side config (`side_config_path`). `strict`:
/// the weights were written for that target, and each config must be as convert writes it
/// (`problem`'s `exact`). Its dtype keys are not judged: convert leaves a model config it
/// was not given as it is, whatever dtype it says (an output's record does not say whether
/// `config` was given).
/// Returns its path and why.
pub fn wrong_config(
    dst: &Path,
    weights: Weights<'_>,
    strict: Option<Target>,
) -> Option<(PathBuf, String)> {
    let side = side_config_path(dst);
    let side = side.is_file().then_some(side);
    for path in model_config(dst).into_iter().chain(side) {
        let text = crate::run::json::read_model_config(&path).unwrap_or_default();
        let why = problem(&text, weights, strict.is_some());
        if let Some(why) = why {
            return Some((path, why));
        }
    }
    None
}

/// Files beside the lone output `dst` named as the shards or index of its stem
/// (`model-00001-of-00002.safetensors`, `model.safetensors.index.json` beside
/// `model.safetensors`), which a loader would take for the output: an earlier re-sharding's.
pub fn leftovers(dst: &Path) -> Vec<OsString> {
    let Some(name) = dst.file_name() else {
        return Vec::new();
    };
    let Some(stem) = name.as_bytes().strip_suffix(b".safetensors") else {
        return Vec::new();
    };
    let dir = crate::output::parent_dir(dst);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut names: Vec<OsString> = entries
        .filter_map(|e| Some(e.ok()?.file_name()))
        .filter(|n| n != name && crate::naming::names_output(n.as_bytes(), |s| s == stem))
        .collect();
    names.sort_by_key(|n| (!n.as_bytes().ends_with(b".index.json"), n.clone()));
    names
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::json::config_text;

    #[test]
    fn a_config_must_describe_the_weights_beside_it() {
        let dense = Weights::Dense;
        assert_eq!(
            problem("{\"torch_dtype\": \"bfloat16\"}", dense, true),
            None
        );
        let q = "{\"quantization_config\": {\"quant_method\": \"compressed-tensors\"}}";
        assert!(problem(q, dense, false)
            .unwrap()
            .contains("`quantization_config`"));
        let c = "{\"compression_config\": {}}";
        assert!(problem(c, dense, false)
            .unwrap()
            .contains("`compression_config`"));
        // No JSON object says nothing of dense weights; FP8 ones need one.
        assert_eq!(problem("[1]", dense, false), None);
        let fp8 = Weights::Fp8 {
            target: Target::Fp8,
            modules: None,
        };
        assert_eq!(
            problem("[1]", fp8, false).as_deref(),
            Some("is not a JSON object")
        );
        assert!(problem("{}", fp8, false)
            .unwrap()
            .contains("has no compressed-tensors"));
        // stcast's own, in any layout, describes them; fp8-block's does not.
        let ours = config_text("{}", Target::Fp8, false, Some(&[]))
            .unwrap()
            .unwrap();
        let compact: Value = serde_json::from_str(&ours).unwrap();
        for exact in [true, false] {
            assert_eq!(problem(&ours, fp8, exact), None);
            assert_eq!(problem(&compact.to_string(), fp8, exact), None);
        }
        let block = config_text("{}", Target::Fp8Block, false, Some(&[]))
            .unwrap()
            .unwrap();
        assert!(problem(&block, fp8, true).is_some());
        let wrong = problem(&block, fp8, false).unwrap();
        assert!(wrong.contains("`weights.block_structure`"), "{wrong}");
        // The modules: a quantized one ignored, an unquantized one targeted and not ignored.
        let modules = Modules {
            quantized: [("a".to_string(), (vec![4, 4], vec![4, 1]))].into(),
            unquantized: vec!["lm_head".into()],
        };
        let fp8 = Weights::Fp8 {
            target: Target::Fp8,
            modules: Some(&modules),
        };
        let wrong = problem(&ours, fp8, false).unwrap();
        assert!(wrong.contains("`lm_head`"), "{wrong}");
        let named = config_text("{}", Target::Fp8, false, Some(&["lm_head".into()]));
        let named = named.unwrap().unwrap();
        assert_eq!(problem(&named, fp8, false), None);
        assert_eq!(problem(&named, fp8, true), None);
        let all = named.replace("\"lm_head\"", "\"re:.*\"");
        let wrong = problem(&all, fp8, false).unwrap();
        assert!(wrong.contains("`a`"), "{wrong}");
    }

    #[test]
    fn one_description_of_the_quantization() {
        // r20: an older tool's `compression_config` beside stcast's quantization_config.
        let fp8 = Weights::Fp8 {
            target: Target::Fp8,
            modules: None,
        };
        let ours = config_text("{}", Target::Fp8, false, Some(&[]))
            .unwrap()
            .unwrap();
        let mut doc: Map<String, Value> = serde_json::from_str(&ours).unwrap();
        doc.insert(
            "compression_config".into(),
            serde_json::json!({"format": "x"}),
        );
        let two = Value::Object(doc).to_string();
        for exact in [true, false] {
            let wrong = problem(&two, fp8, exact).unwrap();
            assert!(wrong.contains("`compression_config`"), "{wrong}");
        }
    }

    #[test]
    fn a_given_config_beside_a_lone_output_has_the_target_s_dtype() {
        // r2: what a `--config` run wrote is judged as a folder's config, its own source.
        let dir = std::env::temp_dir().join(format!("stcast-given-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let dst = dir.join("model.safetensors");
        let given = "{\"torch_dtype\": \"float32\",\n \"text_config\": {\"dtype\": \"float32\"}}";
        let missing = given_config(&dst, Target::Bf16, true).unwrap();
        assert!(missing.ends_with("config.json: is missing: DST's record says convert wrote it beside the output (--config)"), "{missing}");
        for to in [Target::Bf16, Target::F16, Target::Fp8] {
            let written = crate::run::json::written_config(given, to, false, None).unwrap();
            std::fs::write(dir.join("config.json"), &written).unwrap();
            assert_eq!(given_config(&dst, to, true), None);
            assert_eq!(given_config(&dst, to, false), None);
            // Another target's dtype: strict and loose fail it, under FP8 too (attack a3
            // F4: a loader casts the tensors left unquantized to it).
            let other = if to == Target::F16 {
                Target::Bf16
            } else {
                Target::F16
            };
            let wrong = crate::run::json::written_config(given, other, false, None).unwrap();
            std::fs::write(dir.join("config.json"), &wrong).unwrap();
            for exact in [true, false] {
                let why = given_config(&dst, to, exact).unwrap();
                assert!(why.ends_with(GIVEN_CONFIG_DIFFERS), "{why}");
            }
            // The same data in another layout: loose only.
            let compact: Value = serde_json::from_str(&written).unwrap();
            std::fs::write(dir.join("config.json"), compact.to_string()).unwrap();
            assert_eq!(given_config(&dst, to, false), None);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_fp8_output_is_described_where_a_run_writes_its_quantization_config() {
        // Attack a3 F3, F5: its side config, or its folder's (of which it is one file).
        let dir = std::env::temp_dir().join(format!("stcast-described-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let dst = dir.join("out.safetensors");
        assert!(!described(&dst));
        assert_eq!(configured(&dst), None);
        let block = config_text("{}", Target::Fp8Block, false, Some(&[]));
        let block = block.unwrap().unwrap();
        for name in [
            "out.quantization_config.json",
            FOLDER_SIDE_CONFIG,
            "config.json",
        ] {
            std::fs::write(dir.join(name), &block).unwrap();
            assert!(described(&dst), "{name}");
            std::fs::remove_file(dir.join(name)).unwrap();
        }
        // A model config without a quantization key describes no FP8 weights.
        std::fs::write(dir.join("config.json"), b"{\"torch_dtype\": \"bfloat16\"}").unwrap();
        assert!(!described(&dst));
        // The target an output without a record has: its side config's strategy.
        std::fs::write(side_config_path(&dst), &block).unwrap();
        assert_eq!(configured(&dst), Some(Target::Fp8Block));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_earlier_resharding_beside_a_lone_output_is_found() {
        let dir = std::env::temp_dir().join(format!("stcast-beside-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for name in [
            "model-00001-of-00002.safetensors",
            "model.safetensors.index.json",
            "other.safetensors",
            "model-fp8.safetensors",
        ] {
            std::fs::write(dir.join(name), b"").unwrap();
        }
        let left = leftovers(&dir.join("model.safetensors"));
        assert_eq!(
            left,
            [
                "model.safetensors.index.json",
                "model-00001-of-00002.safetensors"
            ]
        );
        assert!(leftovers(&dir.join("other.safetensors")).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
