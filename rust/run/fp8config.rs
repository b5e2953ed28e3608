//! What an FP8 output's `quantization_config` must say of the tensors beside it, as verify
//! judges a config another tool (or an earlier run) wrote: the modules the shards hold
//! quantized and not (`Modules`), the first thing a config says otherwise (`problem`), and
//! the FP8 target a config's strategy names (`strategy_target`). The text stcast writes is
//! `run::json::config_text`'s; `quantization_config` reads it back.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::Result;
use crate::header::SourceHeader;
use crate::input::InputOptions;
use crate::quant::{names_module, pattern_problem, python_end, unquantized_module, SCALE_SUFFIXES};
use crate::run::json::{self, config_text};
use crate::source::Source;
use crate::text::esc;
use crate::vocab::Target;

/// An FP8 output's modules with a 2-D weight: quantized (an F8_E4M3 `M.weight` with its
/// scale `M.weight_scale` in the same file), with the weight's and the scale's shapes, or
/// not (whatever its dtype); each sorted, each once.
#[derive(Debug, Clone, Default)]
pub struct Modules {
    pub quantized: BTreeMap<String, (Vec<usize>, Vec<usize>)>,
    pub unquantized: Vec<String>,
}

impl Modules {
    /// The modules of an output's header (the rule `Plan::unquantized_modules` applies,
    /// `quant::unquantized_module`).
    pub fn of(header: &SourceHeader) -> Modules {
        let mut m = Modules::default();
        m.add(header);
        m.unquantized.sort();
        m.unquantized.dedup();
        m
    }

    /// The modules of the safetensors files in the folder of DST's file `rel` (headers
    /// only), as a config there must describe them (`of_files`).
    pub fn beside(dst: &Path, rel: &Path) -> Result<Modules> {
        let dir = crate::output::parent_dir(&dst.join(rel));
        let read =
            std::fs::read_dir(&dir).map_err(|e| crate::error::Error::io(&dir, "cannot list", e));
        let mut paths: Vec<_> = read?.filter_map(|e| Some(e.ok()?.path())).collect();
        paths.sort();
        paths
            .retain(|p| p.as_os_str().as_encoded_bytes().ends_with(b".safetensors") && p.is_file());
        Modules::of_files(&paths)
    }

    /// The modules of the safetensors files `paths` (headers only); a module of two files,
    /// the last's.
    pub fn of_files(paths: &[PathBuf]) -> Result<Modules> {
        let mut m = Modules::default();
        for path in paths {
            m.add(&Source::open_any(path, &InputOptions::default())?.header);
        }
        m.unquantized.sort();
        m.unquantized.dedup();
        Ok(m)
    }

    fn add(&mut self, header: &SourceHeader) {
        use safetensors::tensor::Dtype;
        let shapes: HashMap<&str, &Vec<usize>> = header
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), &t.shape))
            .collect();
        for t in &header.tensors {
            let Some(module) = unquantized_module(&t.name, &t.shape) else {
                continue;
            };
            let scale = shapes.get(format!("{}{}", t.name, SCALE_SUFFIXES[0]).as_str());
            match (t.dtype == Dtype::F8_E4M3, scale) {
                (true, Some(&scale)) => {
                    let shapes = (t.shape.clone(), scale.clone());
                    self.quantized.insert(module.to_string(), shapes);
                }
                _ => self.unquantized.push(module.to_string()),
            }
        }
    }
}

/// The `quantization_config` stcast writes for `target` (`run::json::config_text`), its
/// `ignore` the modules `ignore` (empty: none).
pub fn quantization_config(target: Target, ignore: &[String]) -> Map<String, Value> {
    let text = config_text("{}", target, false, Some(ignore))
        .ok()
        .flatten();
    let doc = text.and_then(|t| serde_json::from_str::<Value>(&t).ok());
    match doc {
        Some(Value::Object(mut d)) => match d.remove("quantization_config") {
            Some(Value::Object(q)) => q,
            _ => Map::new(),
        },
        _ => Map::new(),
    }
}

/// What in an FP8 output's model config does not describe its tensors (`problem`,
/// `same_config`): each says it in words (`Display`, a message template).
#[derive(Debug, Clone, PartialEq)]
pub enum Problem {
    NotJson,
    NotObject,
    NoConfig,
    /// Its `format` or `quantization_status` is `got`, not `want`.
    Key {
        key: &'static str,
        got: Value,
        want: Value,
    },
    /// A key for tensors the output holds none of is set.
    Set {
        key: &'static str,
    },
    NoGroups,
    GroupNotObject {
        group: String,
    },
    GroupFormat {
        group: String,
        got: Value,
        want: Value,
    },
    /// A group's weights or activations (`at`: the key, or the key and member) say `got`.
    Scheme {
        group: String,
        at: String,
        got: Value,
        want: Value,
        target: Target,
    },
    Targets {
        group: String,
    },
    Ignore,
    NotRegex {
        pattern: String,
        why: String,
    },
    IgnoresQuantized {
        entry: String,
        module: String,
    },
    NotTargeted {
        module: String,
    },
    ScaleShape {
        module: String,
        got: Vec<usize>,
        want: Vec<usize>,
    },
    NotIgnored {
        module: String,
    },
    /// Not SRC's config but for its dtype keys and `quantization_config`.
    OtherKeys,
    /// SRC's config but for its `quantization_config` and its dtype keys, which say neither
    /// SRC's dtype nor the one `target` writes.
    Dtype {
        target: Target,
    },
    /// Another quantization key (`json::QUANTIZATION_KEYS`) beside the `quantization_config`:
    /// a second description of the weights, which a loader may read instead.
    TwoDescriptions {
        key: &'static str,
    },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::NotJson => write!(f, "is not JSON"),
            Problem::NotObject => write!(f, "is not a JSON object"),
            Problem::NoConfig => write!(f, "has no compressed-tensors quantization_config"),
            Problem::Key { key, got, want } => write!(
                f,
                "quantization_config `{key}` is {}, not {}",
                show(got),
                show(want)
            ),
            Problem::Set { key } => write!(
                f,
                "quantization_config `{key}` is set, but the tensors hold none"
            ),
            Problem::NoGroups => write!(f, "quantization_config has no config_groups"),
            Problem::GroupNotObject { group } => {
                write!(f, "config group `{}` is not an object", esc(group))
            }
            Problem::GroupFormat { group, got, want } => write!(
                f,
                "config group `{}` `format` is {}, not {}",
                esc(group),
                show(got),
                show(want)
            ),
            Problem::Scheme {
                group,
                at,
                got,
                want,
                target,
            } => write!(
                f,
                "config group `{}` `{}` is {}, not {} as in {{{{to={}}}}}'s tensors",
                esc(group),
                esc(at),
                show(got),
                show(want),
                target.name()
            ),
            Problem::Targets { group } => write!(
                f,
                "config group `{}` `targets` is not a list of names",
                esc(group)
            ),
            Problem::Ignore => write!(f, "quantization_config `ignore` is not a list of names"),
            Problem::NotRegex { pattern, why } => write!(
                f,
                "quantization_config pattern `{}` is not a regex ({})",
                esc(pattern),
                esc(why)
            ),
            Problem::IgnoresQuantized { entry, module } => write!(
                f,
                "`ignore` entry `{}` names `{}`, whose weight is quantized (a loader would \
                 read its FP8 codes as weights)",
                esc(entry),
                esc(module)
            ),
            Problem::NotTargeted { module } => write!(
                f,
                "no config group's `targets` names `{}`, whose weight is quantized",
                esc(module)
            ),
            Problem::ScaleShape { module, got, want } => write!(
                f,
                "`{}.weight_scale` is shaped {}, not {} as the config's strategy gives",
                esc(module),
                shape(got),
                shape(want)
            ),
            Problem::NotIgnored { module } => write!(
                f,
                "`{m}.weight` is not quantized, but `ignore` does not name `{m}` (a loader \
                 would read it as FP8 with a made-up scale)",
                m = esc(module)
            ),
            Problem::OtherKeys => write!(
                f,
                "is not SRC's config with a quantization_config (its other keys differ)"
            ),
            Problem::Dtype { target } => write!(
                f,
                "is SRC's config with a quantization_config, but its dtype is neither SRC's \
                 nor the one {{{{to={}}}}} writes",
                target.name()
            ),
            Problem::TwoDescriptions { key } => write!(
                f,
                "has a `{key}` beside its quantization_config: another description of the \
                 weights, which a loader may read instead"
            ),
        }
    }
}

/// A config value as Python's `json.dumps(value, sort_keys=True)` spells it, for a template.
fn show(value: &Value) -> String {
    let text = value.to_string();
    let dump = json::Dump {
        sort_keys: true,
        ..json::Dump::indented(None)
    };
    let shown = json::parse(&text).map_or(text.clone(), |node| dump.text(&node));
    esc(&shown).into_owned()
}

/// A shape as Python's `repr` of a list spells it: `[256, 1]`.
fn shape(dims: &[usize]) -> String {
    let dims: Vec<String> = dims.iter().map(usize::to_string).collect();
    format!("[{}]", dims.join(", "))
}

/// Is `v` false to Python (`null`, `false`, zero, empty)?
fn falsy(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
    }
}

/// Keys of a scheme's arguments that do not change how its tensors load: dropped, with
/// every key whose value is null (compressed-tensors 0.19 writes them as null, 0.20 leaves
/// them out), before a scheme is compared.
const LOAD_INERT: [&str; 2] = ["observer", "observer_kwargs"];

/// A scheme's arguments (weights, activations) as they matter to a loader.
fn scheme(args: Option<&Value>) -> Value {
    match args {
        Some(Value::Object(m)) => Value::Object(
            m.iter()
                .filter(|(k, v)| !v.is_null() && !LOAD_INERT.contains(&k.as_str()))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        ),
        Some(v) => v.clone(),
        None => Value::Null,
    }
}

/// The names of a list of strings, None when it is not one.
fn names(v: Option<&Value>) -> Option<Vec<&str>> {
    v?.as_array()?.iter().map(Value::as_str).collect()
}

/// Does the FP8 output's model config `doc` describe the FP8 tensors `modules` as `target`
/// quantized them? Its `quantization_config` (`problem`), and no other quantization key
/// (`json::QUANTIZATION_KEYS`, which `config_text` drops): the first thing that does not,
/// else None. The rule of every FP8 model config verify judges, a folder's and a lone
/// output's, strict and loose alike.
pub fn config_problem(
    doc: &Map<String, Value>,
    target: Target,
    modules: &Modules,
) -> Option<Problem> {
    two_descriptions(doc).or_else(|| problem(doc.get("quantization_config"), target, modules))
}

/// Another quantization key than `quantization_config` set in the FP8 output's model
/// config `doc` (`Problem::TwoDescriptions`), if any.
pub fn two_descriptions(doc: &Map<String, Value>) -> Option<Problem> {
    let other = json::QUANTIZATION_KEYS
        .iter()
        .filter(|k| **k != "quantization_config")
        .find(|k| doc.get(**k).is_some_and(|v| !v.is_null()));
    other.map(|&key| Problem::TwoDescriptions { key })
}

/// Does the `quantization_config` `q` describe the FP8 tensors `modules` as `target` (fp8,
/// fp8-block) quantized them? The first thing that does not, else None.
///
/// The check verify makes of every FP8 output's config, strict and loose alike (a loader
/// trusts the config: a quantized module in `ignore` loads its E4M3 codes as weights, an
/// unquantized weight outside it gets a made-up scale). Layout, group names, `version` and
/// the keys compressed-tensors versions write or leave out (null) may differ; `ignore` and
/// `targets` are judged by the modules they name (`quant::names_module`).
pub fn problem(q: Option<&Value>, target: Target, modules: &Modules) -> Option<Problem> {
    let Some(Value::Object(q)) = q else {
        return Some(Problem::NoConfig);
    };
    if q.get("quant_method").and_then(Value::as_str) != Some("compressed-tensors") {
        return Some(Problem::NoConfig);
    }
    let want = quantization_config(target, &[]);
    let got = |m: &Map<String, Value>, k: &str| m.get(k).cloned().unwrap_or(Value::Null);
    for key in ["format", "quantization_status"] {
        if got(q, key) != got(&want, key) {
            let (got, want) = (got(q, key), got(&want, key));
            return Some(Problem::Key { key, got, want });
        }
    }
    for key in [
        "kv_cache_scheme",
        "sparsity_config",
        "moe_sparsity_config",
        "transform_config",
    ] {
        if q.get(key).is_some_and(|v| !falsy(v)) {
            return Some(Problem::Set { key });
        }
    }
    let groups = match q.get("config_groups") {
        Some(Value::Object(g)) if !g.is_empty() => g,
        _ => return Some(Problem::NoGroups),
    };
    let ours = want.get("config_groups").and_then(Value::as_object);
    let ours = ours
        .and_then(|g| g.values().next())
        .cloned()
        .unwrap_or_default();
    let mut targets: Vec<&str> = Vec::new();
    for (name, g) in groups {
        let group = name.clone();
        let Value::Object(g) = g else {
            return Some(Problem::GroupNotObject { group });
        };
        let format = got(g, "format");
        if !format.is_null() && format != got(&want, "format") {
            let want = got(&want, "format");
            return Some(Problem::GroupFormat {
                group,
                got: format,
                want,
            });
        }
        for key in ["weights", "input_activations", "output_activations"] {
            let (got, expect) = (scheme(g.get(key)), scheme(ours.get(key)));
            if got == expect {
                continue;
            }
            let (mut at, mut got_v, mut want_v) = (key.to_string(), got.clone(), expect.clone());
            if let (Value::Object(a), Value::Object(b)) = (&got, &expect) {
                let k = a
                    .keys()
                    .chain(b.keys())
                    .filter(|k| a.get(*k) != b.get(*k))
                    .min();
                if let Some(k) = k {
                    at = format!("{key}.{k}");
                    got_v = a.get(k).cloned().unwrap_or(Value::Null);
                    want_v = b.get(k).cloned().unwrap_or(Value::Null);
                }
            }
            return Some(Problem::Scheme {
                group,
                at,
                got: got_v,
                want: want_v,
                target,
            });
        }
        match names(g.get("targets")) {
            Some(t) => targets.extend(t),
            None => return Some(Problem::Targets { group }),
        }
    }
    let Some(ignore) = names(q.get("ignore")) else {
        return Some(Problem::Ignore);
    };
    for p in ignore.iter().chain(&targets) {
        if let Some(why) = p
            .strip_prefix("re:")
            .and_then(|_| pattern_problem(&python_end(p)))
        {
            let pattern = p.to_string();
            return Some(Problem::NotRegex { pattern, why });
        }
    }
    let block = ours["weights"]["block_structure"].as_array().map(|b| {
        let side = |i: usize| b.get(i).and_then(Value::as_u64).unwrap_or(1) as usize;
        (side(0), side(1))
    });
    // `names_module`, the `\Z` of stcast's own entries read as Python reads it.
    let names_it = |e: &str, m: &str| names_module(&python_end(e), m);
    let named = |list: &[&str], m: &str| list.iter().any(|e| names_it(e, m));
    for (module, (weight, scale)) in &modules.quantized {
        if let Some(hit) = ignore.iter().find(|p| names_it(p, module)) {
            let (entry, module) = (hit.to_string(), module.clone());
            return Some(Problem::IgnoresQuantized { entry, module });
        }
        if !named(&targets, module) {
            let module = module.clone();
            return Some(Problem::NotTargeted { module });
        }
        let (rows, cols) = (weight[0], weight[1]);
        let expect = match block {
            None => vec![rows, 1],
            Some((r, c)) => vec![rows.div_ceil(r), cols.div_ceil(c)],
        };
        if *scale != expect {
            let (module, got) = (module.clone(), scale.clone());
            return Some(Problem::ScaleShape {
                module,
                got,
                want: expect,
            });
        }
    }
    // A module no group targets is left as it is whether `ignore` names it or not.
    let module = modules
        .unquantized
        .iter()
        .find(|m| named(&targets, m) && !named(&ignore, m));
    module.map(|m| Problem::NotIgnored { module: m.clone() })
}

/// Loose verify: is `got` (another tool's output config) SRC's config `src` (its text), but
/// for its dtype keys, with a quantization_config that describes `modules` as `target`
/// quantized them? The first difference, else None.
pub fn same_config(got: &[u8], src: &str, target: Target, modules: &Modules) -> Option<Problem> {
    let src_text = src;
    let (Ok(doc), Ok(src)) = (
        serde_json::from_slice::<Value>(got),
        serde_json::from_str::<Value>(src_text),
    ) else {
        return Some(Problem::NotJson);
    };
    let (Value::Object(doc), Value::Object(src)) = (doc, src) else {
        return Some(Problem::NotObject);
    };
    if let Some(p) = config_problem(&doc, target, modules) {
        return Some(p);
    }
    // Its dtype SRC's (what another tool leaves) or the target's (what stcast writes, nested
    // configs' too: `json::written_config`), as a dense output's config is the target's: a
    // loader casts the tensors left unquantized to the dtype it names.
    let rest = |m: &Map<String, Value>, dtypes: bool| -> Map<String, Value> {
        let plain = |k: &str| {
            json::QUANTIZATION_KEYS.contains(&k) || (dtypes && json::DTYPE_KEYS.contains(&k))
        };
        let kept = m.iter().filter(|(k, _)| !plain(k));
        kept.map(|(k, v)| (k.clone(), v.clone())).collect()
    };
    let written = json::written_config(src_text, target, false, None).ok();
    let written = written.and_then(|t| serde_json::from_str::<Value>(&t).ok());
    let got = rest(&doc, false);
    let targets = written.as_ref().and_then(Value::as_object);
    if got == rest(&src, false) || targets.is_some_and(|w| rest(w, false) == got) {
        return None;
    }
    match rest(&doc, true) == rest(&src, true) {
        true => Some(Problem::Dtype { target }),
        false => Some(Problem::OtherKeys),
    }
}

/// The FP8 target a model config's compressed-tensors quantization_config says its
/// weights have (fp8: per channel, fp8-block: 128x128 blocks), or None: verify reads the
/// strategy there rather than guess it from a weight whose scale fits both.
pub fn strategy_target(text: &[u8]) -> Option<Target> {
    let doc: Value = serde_json::from_slice(text).ok()?;
    let q = doc.as_object()?.get("quantization_config")?.as_object()?;
    let mut found: Vec<&Value> = Vec::new();
    for g in q.get("config_groups")?.as_object()?.values() {
        let strategy = match g.as_object()?.get("weights").filter(|w| !falsy(w)) {
            None => &Value::Null,
            Some(Value::Object(w)) => w.get("strategy").unwrap_or(&Value::Null),
            Some(_) => continue,
        };
        if !found.contains(&strategy) {
            found.push(strategy);
        }
    }
    if q.get("quant_method").and_then(Value::as_str) != Some("compressed-tensors") {
        return None;
    }
    match found[..] {
        [Value::String(s)] if s == "channel" => Some(Target::Fp8),
        [Value::String(s)] if s == "block" => Some(Target::Fp8Block),
        _ => None,
    }
}

#[cfg(test)]
pub(crate) mod tests;
