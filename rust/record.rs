//! What `convert` records in each output's `__metadata__` (under `KEY`, after the input's
//! own keys in their order): the options that decide the output's bytes, as one compact
//! JSON object. `verify` reads it back and checks DST against those options unless others
//! are given. It asks only `vocab`, and `options` to check its values as convert checks an
//! option's (a record is input: any file may hold one).

use crate::options::Given;
use crate::vocab::{OnOverflow, OptionName, Target};

/// The `__metadata__` key (and the index's `metadata` key) of the record.
pub const KEY: &str = "stcast";

/// The options that decide an output's bytes, as convert ran (defaults left out of the
/// JSON: an absent field is its default).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    /// The target's canonical name (`Target::name`): FP8's strategy is its name.
    pub to: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keep: Vec<String>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub keep_min_size: u64,
    #[serde(default, skip_serializing_if = "is_false")]
    pub from_bf16: bool,
    /// `OnOverflow::name`; absent: warn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_overflow: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub strip_prefix: Vec<String>,
    /// A re-sharding's stem (`convert --name`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// FP8 targets: the model's hidden and (MoE) intermediate sizes its fused experts were
    /// split by (`experts::split`); absent: none was. A folder run's outputs each record
    /// those of the folder's config when it declares experts (`Settings::folder_experts`),
    /// whichever file split them: every output of one run holds one record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<[u64; 2]>,
    /// A folder run's overrides of what it copies (`run::walk::Overrides`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub include: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exclude: Vec<String>,
    /// A lone checkpoint's run given the model's config (`convert --config`): it wrote that
    /// config beside the output as `config.json` (`json::written_config`), which `verify`
    /// then checks as it checks a folder's. Without it the run left any `config.json` there
    /// as it was, whatever dtype it says.
    #[serde(default, skip_serializing_if = "is_false")]
    pub config: bool,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn is_false(b: &bool) -> bool {
    !*b
}

impl Record {
    /// The record of a conversion to `to` (the other options at their defaults).
    pub fn new(to: Target) -> Record {
        Record {
            to: to.name().to_string(),
            keep: Vec::new(),
            keep_min_size: 0,
            from_bf16: false,
            on_overflow: None,
            key: None,
            strip_prefix: Vec::new(),
            name: None,
            experts: None,
            include: Vec::new(),
            exclude: Vec::new(),
            config: false,
        }
    }

    /// The record `text` with the sizes fused experts were split by (`text` as it is when
    /// it is no record `parse` reads).
    pub fn with_experts(text: &str, sizes: [u64; 2]) -> String {
        match Record::parse(text) {
            Ok(r) => Record {
                experts: Some(sizes),
                ..r
            }
            .text(),
            Err(_) => text.to_string(),
        }
    }

    /// Set the overflow policy (warn, the default, is left out).
    pub fn with_on_overflow(mut self, on_overflow: OnOverflow) -> Record {
        self.on_overflow = (on_overflow != OnOverflow::Warn).then(|| on_overflow.name().into());
        self
    }

    /// The compact JSON text written under `KEY`.
    pub fn text(&self) -> String {
        serde_json::to_string(self).expect("a record always serializes")
    }

    /// The record in `text`, as `text` writes it (the one text of each record): else why
    /// not, in words.
    pub fn parse(text: &str) -> Result<Record, String> {
        let r: Record = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if Target::parse(&r.to).is_none_or(|t| t.name() != r.to) {
            return Err(format!("unknown target {:?}", r.to));
        }
        if let Some(o) = &r.on_overflow {
            if OnOverflow::from_name(o).is_none_or(|o| o == OnOverflow::Warn) {
                return Err(format!("unknown on_overflow {o:?}"));
            }
        }
        if r.text() != text {
            return Err("not the text convert writes".into());
        }
        if let Some(why) = r.refused_value() {
            return Err(why);
        }
        // Convert splits fused experts by a model config's sizes (each above 0), under an
        // FP8 target only (`given::Settings::experts`).
        if let Some(sizes) = r.experts {
            if r.target().strategy().is_none() || sizes.contains(&0) {
                return Err(format!("experts {sizes:?} are not what convert records"));
            }
        }
        Ok(r)
    }

    /// The first of its options' values that convert refuses, checked as convert checks an
    /// option given to it (`Given::check`): which, and what it should be.
    fn refused_value(&self) -> Option<String> {
        let text = |s: &String| Given {
            text: Some(s.clone()),
            whole: None,
            repr: format!("{s:?}"),
        };
        let whole = Given {
            text: None,
            whole: Some(self.keep_min_size),
            repr: self.keep_min_size.to_string(),
        };
        let mut values = vec![("to", text(&self.to)), ("keep_min_size", whole)];
        for (name, v) in [
            ("keep", &self.keep),
            ("strip_prefix", &self.strip_prefix),
            ("include", &self.include),
            ("exclude", &self.exclude),
        ] {
            values.extend(v.iter().map(|s| (name, text(s))));
        }
        for (name, v) in [
            ("on_overflow", &self.on_overflow),
            ("key", &self.key),
            ("name", &self.name),
        ] {
            values.extend(v.iter().map(|s| (name, text(s))));
        }
        for (name, given) in values {
            let def = crate::options::find(name).expect("a record's field is an option");
            if let Err(crate::Error::BadOption {
                value, expected, ..
            }) = given.check(def)
            {
                return Some(format!("{name} {value} is not {expected}"));
            }
        }
        // Globs convert compiles before it writes: one it refuses is no record of its own.
        for (option, patterns) in [
            (OptionName::Keep, &self.keep),
            (OptionName::Include, &self.include),
            (OptionName::Exclude, &self.exclude),
        ] {
            if let Err(crate::Error::BadPattern {
                pattern, reason, ..
            }) = crate::pattern::compile_globs(patterns, option)
            {
                return Some(format!(
                    "{} pattern {pattern:?} is not a valid glob ({reason})",
                    option.name()
                ));
            }
        }
        None
    }

    /// The target.
    pub fn target(&self) -> Target {
        Target::parse(&self.to).expect("checked by parse")
    }

    /// The overflow policy.
    pub fn on_overflow(&self) -> OnOverflow {
        self.on_overflow
            .as_deref()
            .and_then(OnOverflow::from_name)
            .unwrap_or(OnOverflow::Warn)
    }
}

/// The value of `KEY` in `meta`, if any.
pub fn find(meta: Option<&[(String, String)]>) -> Option<&str> {
    meta?
        .iter()
        .find(|(k, _)| k == KEY)
        .map(|(_, v)| v.as_str())
}

/// The `__metadata__` of an output of an input with `meta`: with `record`, the input's keys
/// in their order but its own `KEY`, then `KEY`; without, the input's as it is.
pub fn with_record(
    meta: Option<&[(String, String)]>,
    record: Option<&str>,
) -> Option<Vec<(String, String)>> {
    let Some(record) = record else {
        return meta.map(<[_]>::to_vec);
    };
    let mut out: Vec<(String, String)> = meta
        .unwrap_or_default()
        .iter()
        .filter(|(k, _)| k != KEY)
        .cloned()
        .collect();
    out.push((KEY.to_string(), record.to_string()));
    Some(out)
}

/// DST's own record of convert's options: its `record::KEY` entry, whatever SRC's holds
/// (convert replaces SRC's own with its own, the same text or not). None where DST has none,
/// or holds SRC's own unchanged where that is no record convert writes (an output written
/// with `--no-record` keeps SRC's metadata as it is); `Err`: one convert does not write.
pub fn own_record<'a>(
    src: Option<&[(String, String)]>,
    dst: Option<&'a [(String, String)]>,
) -> Option<Result<Record, (&'a str, String)>> {
    let text = find(dst)?;
    match Record::parse(text) {
        Ok(r) => Some(Ok(r)),
        Err(_) if find(src) == Some(text) => None,
        Err(why) => Some(Err((text, why))),
    }
}

/// The record of convert's options that the indexes of a folder output carry: the own
/// record (`own_record`) of its weight file `dst`, an output of SRC's `src` (any file: one
/// that is not safetensors has no record); None where it has none (`--no-record`: the
/// indexes are SRC's, their total size set).
pub fn own_index_record(
    src: &std::path::Path,
    dst: &std::path::Path,
) -> crate::error::Result<Option<String>> {
    // A PyTorch or DCP SRC has no record of its own (nor any `__metadata__` but the one
    // its outputs get).
    let s = crate::source::read_header(src).ok().and_then(|h| h.2);
    let d = crate::source::read_header(dst)?.2;
    Ok(match own_record(s.as_deref(), d.as_deref()) {
        Some(Ok(r)) => Some(r.text()),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_compactly_with_defaults_left_out() {
        let r = Record::new(Target::Bf16);
        assert_eq!(r.text(), r#"{"to":"bf16"}"#);
        let r = Record {
            keep: vec!["*norm*".into()],
            keep_min_size: 4096,
            key: Some("model".into()),
            ..Record::new(Target::Fp8Block)
        }
        .with_on_overflow(OnOverflow::Keep);
        let t = r.text();
        assert_eq!(
            t,
            r#"{"to":"fp8-block","keep":["*norm*"],"keep_min_size":4096,"on_overflow":"keep","key":"model"}"#
        );
        assert_eq!(Record::parse(&t).unwrap(), r);
        assert_eq!(r.on_overflow(), OnOverflow::Keep);
        for bad in [
            r#"{"to":"bf17"}"#,
            r#"{"to":"half"}"#,
            r#"{"to":"bf16","x":1}"#,
            r#"{"to": "bf16"}"#,
            r#"{"to":"bf16","on_overflow":"warn"}"#,
            // Values convert refuses, as it refuses them given as options.
            r#"{"to":"bf16","strip_prefix":[""]}"#,
            r#"{"to":"bf16","name":"a/b"}"#,
            r#"{"to":"bf16","name":""}"#,
            r#"{"to":"bf16","keep_min_size":-1}"#,
            r#"{"to":"bf16","experts":[64,128]}"#,
            r#"{"to":"fp8","experts":[0,128]}"#,
            "",
        ] {
            assert!(Record::parse(bad).is_err(), "{bad}");
        }
        assert!(Record::parse(r#"{"to":"fp8","experts":[64,128]}"#).is_ok());
        // A `--config` run's (r2): true, or left out.
        assert!(Record::parse(r#"{"to":"bf16","config":true}"#).is_ok_and(|r| r.config));
        assert!(Record::parse(r#"{"to":"bf16","config":false}"#).is_err());
        let why = Record::parse(r#"{"to":"bf16","name":"a/b"}"#).unwrap_err();
        assert!(why.starts_with(r#"name "a/b" is not "#), "{why}");
    }

    #[test]
    fn goes_last_replacing_the_inputs_own() {
        let m = |p: &[(&str, &str)]| -> Vec<(String, String)> {
            p.iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect()
        };
        let meta = m(&[("z", "1"), (KEY, "old"), ("a", "2")]);
        assert_eq!(
            with_record(Some(&meta), Some("new")),
            Some(m(&[("z", "1"), ("a", "2"), (KEY, "new")]))
        );
        assert_eq!(with_record(Some(&meta), None), Some(meta.clone()));
        assert_eq!(with_record(None, None), None);
        assert_eq!(with_record(None, Some("r")), Some(m(&[(KEY, "r")])));
        assert_eq!(find(Some(&meta)), Some("old"));
    }
}
