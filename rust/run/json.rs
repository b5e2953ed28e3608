//! Every JSON text stcast writes or edits about a checkpoint: a config's dtype keys and its
//! FP8 `quantization_config`, an index's total size, weight map and shard names.
//!
//! Where stcast edits a user's file, only the values that change are replaced (`Doc::spans`),
//! so key order, indentation, number spelling and escapes stay as the author wrote them.
//! Where it writes a document anew, the text is what Python's `json.dumps` writes for it
//! (the tools that read and write these files are Python's: transformers, compressed-
//! tensors), byte for byte: a document is read as `json.loads` reads one (`NaN`, lone
//! surrogates, duplicate keys of which the last counts, in the first one's place), and
//! numbers and strings are spelled as `json.dumps` spells them (`Dump`).

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt::Write as _;

use crate::vocab::{Strategy, Target};

/// Configs and indexes are a few levels deep; far deeper is an attack on the walks over them.
pub const MAX_DEPTH: usize = 100;

/// The config keys that name the model's dtype (`torch_dtype`, and `dtype` since
/// transformers 4.56).
pub const DTYPE_KEYS: [&str; 2] = ["torch_dtype", "dtype"];

/// The keys under which a model config describes its quantization: transformers'
/// `quantization_config`, and `compression_config`, the older name compressed-tensors wrote
/// (vLLM still reads it). A dequantized checkpoint's config loses every one of them.
pub const QUANTIZATION_KEYS: [&str; 2] = ["quantization_config", "compression_config"];

/// How deeply `parse` reads: far past `MAX_DEPTH` (which the texts a run edits have passed)
/// and the stack of any thread. Python's `json.loads` gives up near 1000.
const MAX_PARSE_DEPTH: usize = 512;

/// A text that is not JSON as Python's `json.loads` reads it: the byte where reading stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotJson(pub usize);

type Parsed<T> = Result<T, NotJson>;

/// A JSON string as Python decodes it: its code points. `Wide` only when it holds a lone
/// surrogate (`"\ud800"`), which no Rust `str` can.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Str<'a> {
    Text(Cow<'a, str>),
    Wide(Vec<u32>),
}

impl Str<'_> {
    fn points(&self) -> Vec<u32> {
        match self {
            Str::Text(s) => s.chars().map(u32::from).collect(),
            Str::Wide(w) => w.clone(),
        }
    }

    fn is(&self, s: &str) -> bool {
        matches!(self, Str::Text(t) if t == s)
    }
}

impl Ord for Str<'_> {
    /// Python's order of `str`: by code point (UTF-8 byte order is the same).
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        match (self, other) {
            (Str::Text(a), Str::Text(b)) => a.as_bytes().cmp(b.as_bytes()),
            _ => self.points().cmp(&other.points()),
        }
    }
}

impl PartialOrd for Str<'_> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// A JSON value as read, or built to be written.
#[derive(Debug, Clone, PartialEq)]
pub enum Value<'a> {
    /// `null`, `true`, `false`, `NaN`, `Infinity`, `-Infinity`, as spelled.
    Literal(&'static str),
    /// A number as spelled in the text (or an integer written here).
    Number(Cow<'a, str>),
    Str(Str<'a>),
    Array(Vec<Node<'a>>),
    /// Every member as it stands in the text, duplicates included (`Node::dict` reads them
    /// as Python's dict does).
    Object(Vec<(Str<'a>, Node<'a>)>),
}

/// A value and its byte span in the text it was read from (empty for a value built here).
#[derive(Debug, Clone, PartialEq)]
pub struct Node<'a> {
    pub value: Value<'a>,
    pub span: (usize, usize),
}

impl<'a> Node<'a> {
    fn new(value: Value<'a>) -> Node<'a> {
        Node {
            value,
            span: (0, 0),
        }
    }

    fn text(s: impl Into<Cow<'a, str>>) -> Node<'a> {
        Node::new(Value::Str(Str::Text(s.into())))
    }

    fn number(n: impl ToString) -> Node<'a> {
        Node::new(Value::Number(Cow::Owned(n.to_string())))
    }

    fn null() -> Node<'a> {
        Node::new(Value::Literal("null"))
    }

    fn object(members: Vec<(&'static str, Node<'a>)>) -> Node<'a> {
        let members = members.into_iter().map(|(k, v)| (Str::Text(k.into()), v));
        Node::new(Value::Object(members.collect()))
    }

    /// An object's members as Python's dict holds them: each key once, in the place of its
    /// first occurrence, with the value of its last. None for other values.
    pub fn dict(&self) -> Option<Vec<(&Str<'a>, &Node<'a>)>> {
        let Value::Object(members) = &self.value else {
            return None;
        };
        let mut at: HashMap<&Str<'a>, usize> = HashMap::with_capacity(members.len());
        let mut out: Vec<(&Str<'a>, &Node<'a>)> = Vec::with_capacity(members.len());
        for (k, v) in members {
            match at.get(k) {
                Some(&i) => out[i].1 = v,
                None => {
                    at.insert(k, out.len());
                    out.push((k, v));
                }
            }
        }
        Some(out)
    }

    /// A member's value, as `dict.get` finds it (the last of a duplicated key).
    pub fn get(&self, key: &str) -> Option<&Node<'a>> {
        let Value::Object(members) = &self.value else {
            return None;
        };
        members
            .iter()
            .rev()
            .find(|(k, _)| k.is(key))
            .map(|(_, v)| v)
    }

    /// A copy of an object's members as a dict holds them, to build a new document from.
    fn members(&self) -> Vec<(Str<'a>, Node<'a>)> {
        let dict = self.dict().unwrap_or_default();
        dict.into_iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }
}

/// `members` with `key` set to `value`: in its place if it is there, else appended (Python's
/// `d[key] = value`).
fn set_member<'a>(members: &mut Vec<(Str<'a>, Node<'a>)>, key: &'static str, value: Node<'a>) {
    match members.iter_mut().find(|(k, _)| k.is(key)) {
        Some(m) => m.1 = value,
        None => members.push((Str::Text(key.into()), value)),
    }
}

/// The compressed-tensors schemes of a model config's text (`quant::Scheme`, one per
/// `config_groups` entry with `weights`): none under another quant_method, or none set.
pub fn schemes(text: &str) -> Parsed<(Vec<crate::quant::Scheme>, Vec<String>)> {
    let doc = parse(text)?;
    let q = QUANTIZATION_KEYS
        .iter()
        .find_map(|k| doc.get(k).filter(|v| v.value != Value::Literal("null")));
    let text_of = |n: Option<&Node<'_>>| match n.map(|n| &n.value) {
        Some(Value::Str(Str::Text(s))) => Some(s.to_string()),
        _ => None,
    };
    let Some(q) =
        q.filter(|q| text_of(q.get("quant_method")).as_deref() == Some("compressed-tensors"))
    else {
        return Ok((Vec::new(), Vec::new()));
    };
    // A list's strings (what is not one is left out: it names no module).
    let names = |n: Option<&Node<'_>>| match n.map(|n| &n.value) {
        Some(Value::Array(items)) => items.iter().filter_map(|i| text_of(Some(i))).collect(),
        _ => Vec::new(),
    };
    let number = |n: Option<&Node<'_>>| match n.map(|n| &n.value) {
        Some(Value::Number(s)) => s.parse::<u64>().ok(),
        _ => None,
    };
    let flag = |n: Option<&Node<'_>>| match n.map(|n| &n.value) {
        Some(Value::Literal("true")) => Some(true),
        Some(Value::Literal("false")) => Some(false),
        _ => None,
    };
    let mut out = Vec::new();
    let groups = q
        .get("config_groups")
        .and_then(Node::dict)
        .unwrap_or_default();
    for (_, g) in groups {
        let Some(w) = g
            .get("weights")
            .filter(|w| matches!(w.value, Value::Object(_)))
        else {
            continue;
        };
        out.push(crate::quant::Scheme {
            // `mixed-precision` names no one format: each group says its own.
            format: text_of(g.get("format"))
                .or_else(|| text_of(q.get("format")))
                .filter(|f| f != "mixed-precision"),
            kind: text_of(w.get("type")),
            num_bits: number(w.get("num_bits")),
            strategy: text_of(w.get("strategy")),
            group_size: number(w.get("group_size")),
            symmetric: flag(w.get("symmetric")),
            targets: names(g.get("targets")),
        });
    }
    Ok((out, names(q.get("ignore"))))
}

/// A model config (a lone file's `--config`, a folder run's own): the text of a regular
/// file holding a JSON object, of at most 16 MiB. One reader for every use.
pub fn read_model_config(path: &std::path::Path) -> crate::Result<String> {
    use std::io::Read;
    const MAX: u64 = 16 << 20;
    let invalid = |reason| crate::error::Error::BadConfig {
        path: path.to_path_buf(),
        reason,
    };
    let (file, meta) = crate::source::open_regular(path)?;
    if meta.len() > MAX {
        return Err(invalid("more than 16 MiB"));
    }
    // Its size, checked above, sizes the one read (a file grown since reads short of it).
    let mut bytes = vec![0; meta.len() as usize];
    (&file)
        .read_exact(&mut bytes)
        .map_err(|e| crate::error::Error::io(path, "cannot read", e))?;
    let text = String::from_utf8(bytes).map_err(|_| invalid("not UTF-8 text"))?;
    match parse(&text) {
        Ok(doc) if matches!(doc.value, Value::Object(_)) => Ok(text),
        // (transformers' `json.load` refuses it too.)
        _ if text.starts_with('\u{feff}') => Err(invalid("starts with a byte-order mark")),
        _ => Err(invalid("not a JSON object")),
    }
}

/// Read `text` as Python's `json.loads` does (`strict`: no raw control characters in
/// strings; `NaN` and `Infinity` allowed; nested at most `MAX_PARSE_DEPTH` levels).
pub fn parse(text: &str) -> Parsed<Node<'_>> {
    let mut p = Parser {
        text,
        b: text.as_bytes(),
        depth: 0,
    };
    let at = p.skip(0);
    let (node, end) = p.value(at)?;
    let end = p.skip(end);
    if end != text.len() {
        return Err(NotJson(end));
    }
    Ok(node)
}

struct Parser<'a> {
    text: &'a str,
    b: &'a [u8],
    depth: usize,
}

impl<'a> Parser<'a> {
    fn skip(&self, mut i: usize) -> usize {
        while matches!(self.b.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            i += 1;
        }
        i
    }

    fn value(&mut self, i: usize) -> Parsed<(Node<'a>, usize)> {
        let rest = &self.text[i.min(self.text.len())..];
        let literal = [
            ("null", "null"),
            ("true", "true"),
            ("false", "false"),
            ("NaN", "NaN"),
            ("Infinity", "Infinity"),
            ("-Infinity", "-Infinity"),
        ]
        .into_iter()
        .find(|(s, _)| rest.starts_with(s));
        let node = |value, end| {
            Ok((
                Node {
                    value,
                    span: (i, end),
                },
                end,
            ))
        };
        match self.b.get(i) {
            None => Err(NotJson(i)),
            Some(b'{' | b'[') => {
                self.depth += 1;
                if self.depth > MAX_PARSE_DEPTH {
                    return Err(NotJson(i));
                }
                let out = if self.b[i] == b'{' {
                    self.object(i)
                } else {
                    self.array(i)
                };
                self.depth -= 1;
                out
            }
            Some(b'"') => {
                let (s, end) = self.string(i)?;
                node(Value::Str(s), end)
            }
            _ if literal.is_some() => {
                let (s, v) = literal.unwrap();
                node(Value::Literal(v), i + s.len())
            }
            _ => {
                let end = self.number(i)?;
                node(Value::Number(Cow::Borrowed(&self.text[i..end])), end)
            }
        }
    }

    fn object(&mut self, start: usize) -> Parsed<(Node<'a>, usize)> {
        let mut members = Vec::new();
        let mut i = self.skip(start + 1);
        if self.b.get(i) != Some(&b'}') {
            loop {
                if self.b.get(i) != Some(&b'"') {
                    return Err(NotJson(i));
                }
                let (key, end) = self.string(i)?;
                i = self.skip(end);
                if self.b.get(i) != Some(&b':') {
                    return Err(NotJson(i));
                }
                let (value, end) = self.value(self.skip(i + 1))?;
                members.push((key, value));
                i = self.skip(end);
                match self.b.get(i) {
                    Some(b',') => i = self.skip(i + 1),
                    Some(b'}') => break,
                    _ => return Err(NotJson(i)),
                }
            }
        }
        let end = i + 1;
        Ok((
            Node {
                value: Value::Object(members),
                span: (start, end),
            },
            end,
        ))
    }

    fn array(&mut self, start: usize) -> Parsed<(Node<'a>, usize)> {
        let mut items = Vec::new();
        let mut i = self.skip(start + 1);
        if self.b.get(i) != Some(&b']') {
            loop {
                let (value, end) = self.value(i)?;
                items.push(value);
                i = self.skip(end);
                match self.b.get(i) {
                    Some(b',') => i = self.skip(i + 1),
                    Some(b']') => break,
                    _ => return Err(NotJson(i)),
                }
            }
        }
        let end = i + 1;
        Ok((
            Node {
                value: Value::Array(items),
                span: (start, end),
            },
            end,
        ))
    }

    /// Python's number grammar: `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?`, where a
    /// fraction or exponent missing its digits is not part of the number.
    fn number(&self, start: usize) -> Parsed<usize> {
        let digits = |mut i: usize| {
            while self.b.get(i).is_some_and(u8::is_ascii_digit) {
                i += 1;
            }
            i
        };
        let mut i = start + usize::from(self.b.get(start) == Some(&b'-'));
        match self.b.get(i) {
            Some(b'0') => i += 1,
            Some(b'1'..=b'9') => i = digits(i),
            _ => return Err(NotJson(start)),
        }
        if self.b.get(i) == Some(&b'.') && self.b.get(i + 1).is_some_and(u8::is_ascii_digit) {
            i = digits(i + 1);
        }
        if matches!(self.b.get(i), Some(b'e' | b'E')) {
            let j = i + 1 + usize::from(matches!(self.b.get(i + 1), Some(b'-' | b'+')));
            if self.b.get(j).is_some_and(u8::is_ascii_digit) {
                i = digits(j);
            }
        }
        Ok(i)
    }

    /// A string from its opening quote: decoded as Python's `scanstring` does (a high
    /// surrogate escape followed by a low one is one character; either alone stays).
    fn string(&self, start: usize) -> Parsed<(Str<'a>, usize)> {
        let mut i = start + 1;
        let plain = loop {
            match self.b.get(i) {
                None => return Err(NotJson(i)),
                Some(b'"') => break true,
                Some(b'\\') => break false,
                Some(&c) if c < 0x20 => return Err(NotJson(i)),
                Some(_) => i += 1,
            }
        };
        if plain {
            return Ok((Str::Text(Cow::Borrowed(&self.text[start + 1..i])), i + 1));
        }
        let mut points: Vec<u32> = self.text[start + 1..i].chars().map(u32::from).collect();
        let hex = |at: usize| -> Parsed<u32> {
            let h = self.text.get(at..at + 4).ok_or(NotJson(at))?;
            if !h.bytes().all(|c| c.is_ascii_hexdigit()) {
                return Err(NotJson(at));
            }
            u32::from_str_radix(h, 16).map_err(|_| NotJson(at))
        };
        loop {
            match self.b.get(i) {
                None => return Err(NotJson(i)),
                Some(b'"') => break,
                Some(&c) if c < 0x20 => return Err(NotJson(i)),
                Some(b'\\') => {
                    let e = *self.b.get(i + 1).ok_or(NotJson(i))?;
                    let simple = match e {
                        b'"' => Some('"'),
                        b'\\' => Some('\\'),
                        b'/' => Some('/'),
                        b'b' => Some('\u{8}'),
                        b'f' => Some('\u{c}'),
                        b'n' => Some('\n'),
                        b'r' => Some('\r'),
                        b't' => Some('\t'),
                        b'u' => None,
                        _ => return Err(NotJson(i)),
                    };
                    if let Some(c) = simple {
                        points.push(c.into());
                        i += 2;
                        continue;
                    }
                    let mut c = hex(i + 2)?;
                    i += 6;
                    if (0xd800..0xdc00).contains(&c) && self.text[i..].starts_with("\\u") {
                        let low = hex(i + 2)?;
                        if (0xdc00..0xe000).contains(&low) {
                            c = 0x10000 + ((c - 0xd800) << 10) + (low - 0xdc00);
                            i += 6;
                        }
                    }
                    points.push(c);
                }
                Some(_) => {
                    let c = self.text[i..].chars().next().ok_or(NotJson(i))?;
                    points.push(c.into());
                    i += c.len_utf8();
                }
            }
        }
        let s = match points
            .iter()
            .map(|&p| char::from_u32(p))
            .collect::<Option<String>>()
        {
            Some(s) => Str::Text(Cow::Owned(s)),
            None => Str::Wide(points),
        };
        Ok((s, i + 1))
    }
}

/// How deeply the document `text` (JSON) nests lists and objects, as Python reads it (a
/// duplicated key's earlier values do not count): 0 for a scalar. A text nested past what
/// `parse` reads is counted over its brackets.
pub fn depth(text: &str) -> usize {
    let Ok(doc) = parse(text) else {
        return bracket_depth(text);
    };
    let (mut deepest, mut pending) = (0, vec![(&doc, 1)]);
    while let Some((node, d)) = pending.pop() {
        match &node.value {
            Value::Array(items) => pending.extend(items.iter().map(|v| (v, d + 1))),
            Value::Object(_) => {
                let dict = node.dict().unwrap_or_default();
                pending.extend(dict.into_iter().map(|(_, v)| (v, d + 1)));
            }
            _ => continue,
        }
        deepest = deepest.max(d);
    }
    deepest
}

/// The bracket nesting of `text` outside strings, in constant memory.
fn bracket_depth(text: &str) -> usize {
    let (mut depth, mut deepest, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for &c in text.as_bytes() {
        if in_string {
            match c {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            b'"' => in_string = true,
            b'{' | b'[' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

/// How `json.dumps` is asked to write: its `indent`, `separators`, `sort_keys` and
/// `ensure_ascii`.
#[derive(Debug, Clone)]
pub struct Dump<'s> {
    pub indent: Option<&'s str>,
    pub item_separator: &'s str,
    pub key_separator: &'s str,
    pub sort_keys: bool,
    pub ensure_ascii: bool,
}

impl<'s> Dump<'s> {
    /// `json.dumps(doc, indent=indent)`, its other arguments the defaults.
    pub fn indented(indent: Option<&'s str>) -> Dump<'s> {
        Dump {
            indent,
            item_separator: if indent.is_some() { "," } else { ", " },
            key_separator: ": ",
            sort_keys: false,
            ensure_ascii: true,
        }
    }

    /// The text of `node`, as `json.dumps` writes the document Python reads from it.
    pub fn text(&self, node: &Node<'_>) -> String {
        let mut out = String::new();
        self.write(node, 0, &mut out);
        out
    }

    fn newline(&self, level: usize, out: &mut String) {
        if let Some(indent) = self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    }

    fn write(&self, node: &Node<'_>, level: usize, out: &mut String) {
        match &node.value {
            Value::Literal(s) => out.push_str(s),
            Value::Number(n) => out.push_str(&python_number(n)),
            Value::Str(s) => quote(s, self.ensure_ascii, out),
            Value::Array(items) if items.is_empty() => out.push_str("[]"),
            Value::Array(items) => {
                out.push('[');
                for (k, item) in items.iter().enumerate() {
                    if k > 0 {
                        out.push_str(self.item_separator);
                    }
                    self.newline(level + 1, out);
                    self.write(item, level + 1, out);
                }
                self.newline(level, out);
                out.push(']');
            }
            Value::Object(_) => {
                let mut items = node.dict().unwrap_or_default();
                if items.is_empty() {
                    out.push_str("{}");
                    return;
                }
                if self.sort_keys {
                    items.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (k, (key, value)) in items.into_iter().enumerate() {
                    if k > 0 {
                        out.push_str(self.item_separator);
                    }
                    self.newline(level + 1, out);
                    quote(key, self.ensure_ascii, out);
                    out.push_str(self.key_separator);
                    self.write(value, level + 1, out);
                }
                self.newline(level, out);
                out.push('}');
            }
        }
    }
}

/// A string as `json.dumps` writes it: `ensure_ascii` escapes all but printable ASCII
/// (`encode_basestring_ascii`), else only quotes, backslashes and control characters. A lone
/// surrogate, which Python cannot encode as UTF-8, is always escaped.
fn quote(s: &Str<'_>, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    let mut put = |p: u32| match p {
        0x22 => out.push_str("\\\""),
        0x5c => out.push_str("\\\\"),
        0x0a => out.push_str("\\n"),
        0x0d => out.push_str("\\r"),
        0x09 => out.push_str("\\t"),
        0x08 => out.push_str("\\b"),
        0x0c => out.push_str("\\f"),
        0x20..=0x7e => out.push(p as u8 as char),
        _ if p < 0x20 || (ensure_ascii && p < 0x10000) || (0xd800..0xe000).contains(&p) => {
            let _ = write!(out, "\\u{p:04x}");
        }
        _ if ensure_ascii => {
            let v = p - 0x10000;
            let _ = write!(
                out,
                "\\u{:04x}\\u{:04x}",
                0xd800 + (v >> 10),
                0xdc00 + (v & 0x3ff)
            );
        }
        _ => out.push(char::from_u32(p).unwrap_or('\u{fffd}')),
    };
    match s {
        Str::Text(t) => t.chars().for_each(|c| put(c.into())),
        Str::Wide(w) => w.iter().for_each(|&p| put(p)),
    }
    out.push('"');
}

/// A number as Python writes what it read from `n`: an integer as `int` (`-0` is `0`), any
/// other as `float`'s `repr` (`1e+16`, `1e-05`, `100.0`; `Infinity` past the range).
fn python_number(n: &str) -> Cow<'_, str> {
    if !n.contains(['.', 'e', 'E']) {
        let zero = n.trim_start_matches('-').bytes().all(|c| c == b'0');
        return if zero {
            Cow::Borrowed("0")
        } else {
            Cow::Borrowed(n)
        };
    }
    let x: f64 = n.parse().unwrap_or(f64::NAN);
    Cow::Owned(float_repr(x))
}

/// Python's `repr` of a float: the shortest digits that read back, in fixed notation when
/// the decimal point falls within 16 digits of them (`repr` of `1e16` is `1e+16`).
pub fn float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // The shortest digit count that reads back; then the digits of that count nearest to
    // `x` (Python's choice where several read back), correctly rounded.
    let shortest = format!("{:e}", x.abs());
    let count = shortest
        .split_once('e')
        .map_or(1, |(m, _)| m.len() - usize::from(m.contains('.')));
    let sci = format!("{:.*e}", count - 1, x.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let exp: i64 = exp.parse().unwrap_or(0);
    let decpt = exp + 1;
    let sign = if x < 0.0 { "-" } else { "" };
    let n = digits.len() as i64;
    if -4 < decpt && decpt <= 16 {
        if decpt <= 0 {
            format!("{sign}0.{}{digits}", "0".repeat((-decpt) as usize))
        } else if decpt >= n {
            format!("{sign}{digits}{}.0", "0".repeat((decpt - n) as usize))
        } else {
            let (a, b) = digits.split_at(decpt as usize);
            format!("{sign}{a}.{b}")
        }
    } else {
        let (a, b) = digits.split_at(1);
        let dot = if b.is_empty() {
            String::new()
        } else {
            format!(".{b}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{a}{dot}e{esign}{:02}", exp.abs())
    }
}

/// A key path step: an object member's key or an array index.
enum Step<'n, 'a> {
    Key(&'n Str<'a>),
    Index,
}

/// The spans of the values of every object member (duplicates included) whose key path
/// `wanted` accepts, with those values.
fn spans<'n, 'a>(
    root: &'n Node<'a>,
    wanted: &dyn Fn(&[Step<'n, 'a>]) -> bool,
) -> Vec<&'n Node<'a>> {
    fn walk<'n, 'a>(
        node: &'n Node<'a>,
        path: &mut Vec<Step<'n, 'a>>,
        wanted: &dyn Fn(&[Step<'n, 'a>]) -> bool,
        out: &mut Vec<&'n Node<'a>>,
    ) {
        match &node.value {
            Value::Object(members) => {
                for (k, v) in members {
                    path.push(Step::Key(k));
                    walk(v, path, wanted, out);
                    if wanted(path) {
                        out.push(v);
                    }
                    path.pop();
                }
            }
            Value::Array(items) => {
                for v in items {
                    path.push(Step::Index);
                    walk(v, path, wanted, out);
                    path.pop();
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(root, &mut Vec::new(), wanted, &mut out);
    out
}

/// `text` with each span replaced by its new text.
fn replace(text: &str, mut edits: Vec<((usize, usize), String)>) -> String {
    edits.sort_by_key(|e| e.0);
    let mut out = String::with_capacity(text.len() + 64);
    let mut at = 0;
    for ((start, end), new) in edits {
        out.push_str(&text[at..start]);
        out.push_str(&new);
        at = end;
    }
    out.push_str(&text[at..]);
    out
}

fn is_key(step: &Step<'_, '_>, key: &str) -> bool {
    matches!(step, Step::Key(k) if k.is(key))
}

/// The config with every `torch_dtype`/`dtype` that names a dtype (a string or null) set to
/// `dtype`, or None if it has none. Nested sub-configs (`text_config`, ...) count;
/// `quantization_config` is left alone.
pub fn set_dtypes(text: &str, dtype: &str) -> Parsed<Option<String>> {
    let doc = parse(text)?;
    let wanted = |path: &[Step<'_, '_>]| {
        path.last()
            .is_some_and(|s| DTYPE_KEYS.iter().any(|k| is_key(s, k)))
            && !path.iter().any(|s| is_key(s, "quantization_config"))
    };
    let mut new = String::new();
    quote(&Str::Text(dtype.into()), true, &mut new);
    let edits: Vec<_> = spans(&doc, &wanted)
        .into_iter()
        .filter(|v| matches!(v.value, Value::Str(_) | Value::Literal("null")))
        .map(|v| (v.span, new.clone()))
        .collect();
    Ok((!edits.is_empty()).then(|| replace(text, edits)))
}

/// The index text with `metadata.total_size` set to `total`, all else unchanged. An index
/// without one is written anew in its own style (indent, separators, escapes) with it.
pub fn set_total_size(text: &str, total: u64) -> Parsed<String> {
    let doc = parse(text)?;
    let wanted = |path: &[Step<'_, '_>]| {
        path.len() == 2 && is_key(&path[0], "metadata") && is_key(&path[1], "total_size")
    };
    let edits: Vec<_> = spans(&doc, &wanted)
        .into_iter()
        .map(|v| (v.span, total.to_string()))
        .collect();
    if !edits.is_empty() {
        return Ok(replace(text, edits));
    }
    let mut metadata = vec![(Str::Text("total_size".into()), Node::number(total))];
    if let Some(old) = doc.get("metadata") {
        metadata.extend(old.members());
    }
    let metadata = Node::new(Value::Object(metadata));
    let mut members = doc.members();
    if doc.get("metadata").is_some() {
        set_member(&mut members, "metadata", metadata);
    } else {
        members.insert(0, (Str::Text("metadata".into()), metadata));
    }
    Ok(in_own_style(text, members))
}

/// The index text with `record` (`record::Record::text`) as `metadata.stcast`, after the
/// other metadata keys (an `stcast` there before replaced), re-dumped in its own style.
pub fn with_record(text: &str, record: &str) -> Parsed<String> {
    let doc = parse(text)?;
    let mut metadata = doc.get("metadata").map(Node::members).unwrap_or_default();
    metadata.retain(|(k, _)| !k.is(crate::record::KEY));
    metadata.push((Str::Text(crate::record::KEY.into()), Node::text(record)));
    let mut members = doc.members();
    set_member(&mut members, "metadata", Node::new(Value::Object(metadata)));
    Ok(in_own_style(text, members))
}

/// The record an index's text holds (`metadata.stcast`, a string), if any.
pub fn index_record(text: &str) -> Parsed<Option<String>> {
    let doc = parse(text)?;
    let found = doc.get("metadata").and_then(|m| m.get(crate::record::KEY));
    Ok(match found.map(|n| &n.value) {
        Some(Value::Str(Str::Text(t))) => Some(t.to_string()),
        _ => None,
    })
}

/// An object of `members` dumped as `text` is (indent, separators, escapes, final newline).
fn in_own_style(text: &str, members: Vec<(Str<'_>, Node<'_>)>) -> String {
    // The author's indent: the blanks that open the first indented line.
    let indent = text.match_indices('\n').find_map(|(i, _)| {
        let rest = &text[i + 1..];
        let n = rest.len() - rest.trim_start_matches([' ', '\t']).len();
        let next = rest[n..].chars().next()?;
        (n > 0 && !(next.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&next)))
            .then(|| &rest[..n])
    });
    let compact = indent.is_none() && !text.contains("\": ");
    let dump = Dump {
        item_separator: if compact {
            ","
        } else {
            Dump::indented(indent).item_separator
        },
        key_separator: if compact { ":" } else { ": " },
        ensure_ascii: text.is_ascii() && text.contains("\\u"),
        ..Dump::indented(indent)
    };
    let mut out = dump.text(&Node::new(Value::Object(members)));
    if text.ends_with('\n') {
        out.push('\n');
    }
    out
}

/// The index text with each `weight_map` shard name that `new_name` renames replaced by
/// its new name, all else unchanged.
pub fn rename_shards(text: &str, new_name: &dyn Fn(&str) -> Option<String>) -> Parsed<String> {
    let doc = parse(text)?;
    let wanted = |path: &[Step<'_, '_>]| path.len() == 2 && is_key(&path[0], "weight_map");
    let edits = spans(&doc, &wanted)
        .into_iter()
        .filter_map(|v| match &v.value {
            Value::Str(Str::Text(old)) => new_name(old).map(|new| {
                let mut q = String::new();
                quote(&Str::Text(new.into()), true, &mut q);
                (v.span, q)
            }),
            _ => None,
        });
    Ok(replace(text, edits.collect()))
}

/// The index text with each `weight_map` tensor name that `new_name` renames replaced by
/// its new name, re-dumped in its own style (`in_own_style`: a key has no span of its own
/// to edit in place); the members keep their order.
pub fn rename_tensors(text: &str, new_name: &dyn Fn(&str) -> Option<String>) -> Parsed<String> {
    let doc = parse(text)?;
    let Some(map) = doc.get("weight_map") else {
        return Ok(text.to_string());
    };
    let renamed = map.members().into_iter().map(|(k, v)| match &k {
        Str::Text(t) => match new_name(t) {
            Some(new) => (Str::Text(new.into()), v),
            None => (k, v),
        },
        Str::Wide(_) => (k, v),
    });
    let mut members = doc.members();
    set_member(
        &mut members,
        "weight_map",
        Node::new(Value::Object(renamed.collect())),
    );
    Ok(in_own_style(text, members))
}

/// An index written anew: the source index's members (`source`, none if None or not an
/// object) with `metadata.total_size` set to `total` (the source's other metadata kept) and
/// `weight_map` set to `weight_map` (tensor, shard file), indent 2 and a final newline;
/// `sort_keys` as `save_pretrained` writes one (a re-sharded output), else in the source's
/// order as `model_free_ptq` writes one (an FP8 output, a dequantized one).
pub fn index_text(
    source: Option<&str>,
    total: u64,
    weight_map: &[(String, String)],
    sort_keys: bool,
) -> Parsed<String> {
    let doc = source.map(parse).transpose()?;
    let mut members = doc.as_ref().map(Node::members).unwrap_or_default();
    let mut metadata = match members.iter().find(|(k, _)| k.is("metadata")) {
        Some((_, m)) => m.members(),
        None => Vec::new(),
    };
    set_member(&mut metadata, "total_size", Node::number(total));
    set_member(&mut members, "metadata", Node::new(Value::Object(metadata)));
    let map = weight_map
        .iter()
        .map(|(k, v)| (Str::Text(k.as_str().into()), Node::text(v.as_str())));
    set_member(
        &mut members,
        "weight_map",
        Node::new(Value::Object(map.collect())),
    );
    let dump = Dump {
        sort_keys,
        ..Dump::indented(Some("  "))
    };
    Ok(dump.text(&Node::new(Value::Object(members))) + "\n")
}

/// The one writer of the index texts a run writes: the source's text (`text`) with its size
/// `total` set in place (`set_total_size`), or, given a `weight_map`, written anew
/// (`index_text`); then with `record` in its metadata (`with_record`), if given.
pub fn index(
    text: Option<&str>,
    total: u64,
    weight_map: Option<&[(String, String)]>,
    sort_keys: bool,
    record: Option<&str>,
) -> Parsed<String> {
    let out = match (text, weight_map) {
        (Some(t), None) => set_total_size(t, total),
        (t, map) => index_text(t, total, map.unwrap_or_default(), sort_keys),
    }?;
    match record {
        Some(r) => with_record(&out, r),
        None => Ok(out),
    }
}

/// The config a dequantized checkpoint gets: without its quantization keys, the rest re-
/// dumped with the source's layout (indent 2 if it had lines, else on one line).
pub fn without_quantization(text: &str) -> Parsed<String> {
    let doc = parse(text)?;
    let mut members = doc.members();
    members.retain(|(k, _)| !QUANTIZATION_KEYS.iter().any(|q| k.is(q)));
    let dump = Dump::indented(text.contains('\n').then_some("  "));
    let mut out = dump.text(&Node::new(Value::Object(members)));
    if text.ends_with('\n') {
        out.push('\n');
    }
    Ok(out)
}

/// The `ignore` entry that names `module` and no other for compressed-tensors, which reads
/// `re:X` as a regex matched at the start of a name and any other entry as a name or a class
/// name (a module's class or one it derives from: `Linear`, `Module`). A name that could be
/// read so, one starting with `re:` or an undotted name starting with a capital (class names
/// are CapWords; a dotted name is never one), is written as an escaped regex (Python's
/// `re.escape`) anchored at both ends; any other name as it is, as llm-compressor writes
/// `lm_head`.
pub fn ignore_entry(module: &str) -> String {
    let capital = module.chars().next().is_some_and(char::is_uppercase);
    if !(module.starts_with("re:") || (!module.contains('.') && capital)) {
        return module.to_string();
    }
    let mut out = String::from("re:");
    for c in module.chars() {
        if "()[]{}?*+-|^$\\.&~# \t\n\r\u{b}\u{c}".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out + "\\Z"
}

/// The `quantization_config` of an FP8 target's output, `ignore` its entries for the
/// modules whose 2-D weight stays unquantized: compressed-tensors' own serialisation
/// (0.20.1, `QuantizationConfig`), less the keys that one version writes and an older one
/// refuses (`QuantizationArgs` forbids extra keys): `scale_dtype`, `zp_dtype` (0.19 writes
/// them as null) and `moe_sparsity_config` (new in 0.20). compressed-tensors 0.19.0 and
/// 0.20.1 both validate it (docs/guide.md).
fn quantization_config(strategy: Strategy, ignore: &[String]) -> Node<'_> {
    let block = strategy == Strategy::Block;
    let (yes, no) = (
        Node::new(Value::Literal("true")),
        Node::new(Value::Literal("false")),
    );
    let float = || Node::text("float");
    let mut weights = vec![
        ("dynamic", no.clone()),
        ("group_size", Node::null()),
        ("num_bits", Node::number(8)),
        (
            "strategy",
            Node::text(if block { "block" } else { "channel" }),
        ),
        ("symmetric", yes.clone()),
        ("type", float()),
    ];
    if block {
        let tile = Node::new(Value::Array(vec![Node::number(128), Node::number(128)]));
        weights.insert(0, ("block_structure", tile));
    }
    let activations = vec![
        ("dynamic", yes.clone()),
        (
            "group_size",
            if block {
                Node::number(128)
            } else {
                Node::null()
            },
        ),
        ("num_bits", Node::number(8)),
        (
            "strategy",
            Node::text(if block { "group" } else { "token" }),
        ),
        ("symmetric", yes),
        ("type", float()),
    ];
    let group = Node::object(vec![
        ("format", Node::text("float-quantized")),
        ("input_activations", Node::object(activations)),
        ("output_activations", Node::null()),
        (
            "targets",
            Node::new(Value::Array(vec![Node::text("Linear")])),
        ),
        ("weights", Node::object(weights)),
    ]);
    // The preset names compressed-tensors gives the two schemes, used as the group's name.
    let name = if block { "FP8_BLOCK" } else { "FP8_DYNAMIC" };
    let ignore = ignore.iter().map(|m| Node::text(ignore_entry(m)));
    Node::object(vec![
        ("config_groups", Node::object(vec![(name, group)])),
        ("format", Node::text("float-quantized")),
        ("global_compression_ratio", Node::null()),
        ("ignore", Node::new(Value::Array(ignore.collect()))),
        ("kv_cache_scheme", Node::null()),
        ("quant_method", Node::text("compressed-tensors")),
        ("quantization_status", Node::text("compressed")),
        ("transform_config", Node::object(Vec::new())),
        ("version", Node::text("0.20.1")),
    ])
}

/// What a run writes for a model config: `to`'s dtype in its dtype keys (`set_dtypes`,
/// `Target::torch_name`); a dequantized checkpoint's without its quantization keys
/// (`without_quantization`); an FP8 target's model config with the `quantization_config`
/// of its output, `ignore` the modules left unquantized (each by `ignore_entry`), and no
/// other quantization key (`QUANTIZATION_KEYS`), written as compressed-tensors writes it
/// (indent 2, keys sorted). None: the config is copied as it is.
pub fn config_text(
    text: &str,
    to: Target,
    dequantize: bool,
    ignore: Option<&[String]>,
) -> Parsed<Option<String>> {
    let mut out = match to.torch_name() {
        Some(name) => set_dtypes(text, name)?,
        None => None,
    };
    if dequantize {
        out = Some(without_quantization(out.as_deref().unwrap_or(text))?);
    }
    if let (Some(ignore), Some(strategy)) = (ignore, to.strategy()) {
        let doc = parse(out.as_deref().unwrap_or(text))?;
        let mut members = doc.members();
        // One description of the weights: another quantization key (an older tool's
        // `compression_config`) would say other weights beside stcast's.
        members.retain(|(k, _)| !QUANTIZATION_KEYS.iter().any(|q| k.is(q)));
        set_member(
            &mut members,
            "quantization_config",
            quantization_config(strategy, ignore),
        );
        let dump = Dump {
            sort_keys: true,
            ..Dump::indented(Some("  "))
        };
        out = Some(dump.text(&Node::new(Value::Object(members))) + "\n");
    }
    Ok(out)
}

/// Strict: the bytes stcast writes. Loose (files other tools wrote): the same JSON data,
/// whatever the layout (objects as dicts, the last of a duplicated key).
pub fn same_json(got: &[u8], want: &[u8], loose: bool) -> bool {
    let data = |b| serde_json::from_slice::<serde_json::Value>(b).ok();
    got == want || (loose && data(got).is_some_and(|g| Some(g) == data(want)))
}

/// The model config a run writes of the config text `src` (`config_text`, or `src` as it
/// is when it copies it): what `verify` wants of a folder's config (SRC's) and of the one a
/// lone checkpoint's `--config` run wrote beside its output (its own text, the dtype set:
/// the run wrote it so).
pub fn written_config(
    src: &str,
    to: Target,
    dequantize: bool,
    ignore: Option<&[String]>,
) -> Parsed<String> {
    let out = config_text(src, to, dequantize, ignore)?;
    Ok(out.unwrap_or_else(|| src.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn renamed(text: &str, from: &str, to: &str) -> String {
        rename_shards(text, &|old: &str| (old == from).then(|| to.to_string())).unwrap()
    }

    #[test]
    fn an_index_gets_the_record_last_in_its_metadata_in_its_own_style() {
        let hf = "{\n  \"metadata\": {\n    \"total_size\": 8\n  },\n  \"weight_map\": {\n    \"a\": \"m.safetensors\"\n  }\n}\n";
        let r = r#"{"to":"bf16"}"#;
        let want = "{\n  \"metadata\": {\n    \"total_size\": 4,\n    \"stcast\": \"{\\\"to\\\":\\\"bf16\\\"}\"\n  },\n  \"weight_map\": {\n    \"a\": \"m.safetensors\"\n  }\n}\n";
        let got = index(Some(hf), 4, None, false, Some(r)).unwrap();
        assert_eq!(got, want);
        assert_eq!(index_record(&got).unwrap().as_deref(), Some(r));
        // An earlier record is replaced, last; without one the index is as before.
        let again = with_record(&got, r#"{"to":"fp16"}"#).unwrap();
        assert_eq!(again, want.replace("bf16", "fp16"));
        assert_eq!(
            index(Some(hf), 4, None, false, None).unwrap(),
            hf.replace('8', "4")
        );
        assert_eq!(index_record(hf).unwrap(), None);
    }

    #[test]
    fn dtypes_are_replaced_in_place_only_where_they_name_one() {
        let text =
            "{\"torch_dtype\" :  \"float32\",\n \"x\": 1.50, \"text_config\": {\"dtype\": null,\
                    \"dtype\": {\"a\": 1}}, \"quantization_config\": {\"dtype\": \"float8\"},\
                    \"l\": [{\"torch_dtype\": \"f\\u0033\"}]}";
        let want = "{\"torch_dtype\" :  \"bfloat16\",\n \"x\": 1.50, \"text_config\": {\"dtype\": \"bfloat16\",\
                    \"dtype\": {\"a\": 1}}, \"quantization_config\": {\"dtype\": \"float8\"},\
                    \"l\": [{\"torch_dtype\": \"bfloat16\"}]}";
        assert_eq!(set_dtypes(text, "bfloat16").unwrap().as_deref(), Some(want));
        assert_eq!(
            set_dtypes("{\"dtype\": 3, \"a\": \"torch_dtype\"}", "x"),
            Ok(None)
        );
        // Duplicate keys: every occurrence is edited.
        let dup = "{\"dtype\":\"a\",\"dtype\":\"b\"}";
        assert_eq!(
            set_dtypes(dup, "c").unwrap().unwrap(),
            "{\"dtype\":\"c\",\"dtype\":\"c\"}"
        );
        // An escaped key still names one.
        let esc = "{\"torch_\\u0064type\": \"f\"}";
        assert_eq!(
            set_dtypes(esc, "é").unwrap().unwrap(),
            "{\"torch_\\u0064type\": \"\\u00e9\"}"
        );
        assert!(set_dtypes("{\"a\": ", "x").is_err());
    }

    #[test]
    fn total_size_is_replaced_in_place_or_added_in_the_text_s_style() {
        let t = "{\n\t\"metadata\": {\"total_size\": 1e3, \"x\": 1},\n\t\"weight_map\": {}\n}\n";
        assert_eq!(
            set_total_size(t, 42).unwrap(),
            "{\n\t\"metadata\": {\"total_size\": 42, \"x\": 1},\n\t\"weight_map\": {}\n}\n"
        );
        // No total_size: the document is re-dumped, total_size first in metadata.
        let t = "{\"weight_map\": {\"a\": \"s\"}, \"metadata\": {\"p\": 1.0E16}}";
        assert_eq!(
            set_total_size(t, 7).unwrap(),
            "{\"weight_map\": {\"a\": \"s\"}, \"metadata\": {\"total_size\": 7, \"p\": 1e+16}}"
        );
        let t = "{\"weight_map\":{\"é\":\"s\"}}\n";
        assert_eq!(
            set_total_size(t, 7).unwrap(),
            "{\"metadata\":{\"total_size\":7},\"weight_map\":{\"é\":\"s\"}}\n"
        );
        let t = "{\n   \"weight_map\": {\"\\u00e9\": \"s\", \"\\u00e9\": \"t\"}, \"m\": -0}";
        assert_eq!(
            set_total_size(t, 7).unwrap(),
            "{\n   \"metadata\": {\n      \"total_size\": 7\n   },\n   \"weight_map\": {\n      \
             \"\\u00e9\": \"t\"\n   },\n   \"m\": 0\n}"
        );
    }

    #[test]
    fn shards_are_renamed_in_the_weight_map_only() {
        let t = "{\"weight_map\": {\"a\": \"x.bin\", \"b\":\"y.bin\"}, \"x\": {\"a\": \"x.bin\"}}";
        assert_eq!(
            renamed(t, "x.bin", "x.safetensors"),
            "{\"weight_map\": {\"a\": \"x.safetensors\", \"b\":\"y.bin\"}, \"x\": {\"a\": \"x.bin\"}}"
        );
        assert_eq!(renamed("[1]", "a", "b"), "[1]");
    }

    #[test]
    fn depth_counts_containers_outside_strings() {
        assert_eq!(depth("1"), 0);
        assert_eq!(depth("\"[[[\""), 0);
        assert_eq!(depth("{\"a\": [[], \"[[[\\\"[\"]}"), 3);
        assert_eq!(depth(&"[".repeat(100_000)), 100_000);
        // A duplicated key's shadowed value does not count, as in the dict Python reads.
        assert_eq!(depth("{\"a\": [[1]], \"a\": 1}"), 1);
        assert_eq!(
            depth(&format!("{}1{}", "[".repeat(999), "]".repeat(999))),
            999
        );
    }

    #[test]
    fn dumps_spell_as_python_does() {
        let doc = parse(
            "{\"b\": [1.0, 1e16, 1e15, 0.0001, 0.00001, -0.0, 1e400, -1E400, 12345678901234567890123, \
             NaN, -Infinity, 2.5e-7, 123.456, 1.7976931348623157e308, -1932338281826301.2], \"a\": \"\\ud800\\ud83d\\ude00\\u007f\\u0001\", \"c\": {}, \"d\": []}",
        )
        .unwrap();
        let dump = Dump {
            sort_keys: true,
            ..Dump::indented(None)
        };
        assert_eq!(
            dump.text(&doc),
            "{\"a\": \"\\ud800\\ud83d\\ude00\\u007f\\u0001\", \"b\": [1.0, 1e+16, 1000000000000000.0, \
             0.0001, 1e-05, -0.0, Infinity, -Infinity, 12345678901234567890123, NaN, -Infinity, \
             2.5e-07, 123.456, 1.7976931348623157e+308, -1932338281826301.2], \"c\": {}, \"d\": []}"
        );
        let wide = parse("\"\\ud800é\\u007f\"").unwrap();
        let raw = Dump {
            ensure_ascii: false,
            ..Dump::indented(None)
        };
        assert_eq!(raw.text(&wide), "\"\\ud800é\u{7f}\"");
        for bad in [
            "",
            "01",
            "[1,]",
            "{\"a\" 1}",
            "\"\t\"",
            "1e",
            "{} x",
            "\"\\x\"",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    /// The cases of `tests/fixtures/json/json-dumps.json`, each written by Python's json
    /// module (`make_json.py` there), the writer the tools that read these files use: every
    /// index written anew (keys in the source's order or sorted) and every config that loses
    /// its quantization is `json.dumps` of what `json.loads` reads, byte for byte, whatever
    /// its numbers, escapes and duplicate keys.
    #[test]
    fn documents_written_anew_are_python_s_json_dumps() {
        #[derive(serde::Deserialize)]
        struct Case {
            text: Option<String>,
            weight_map: Vec<(String, String)>,
            total: u64,
            index: String,
            index_sorted: String,
            config: Option<String>,
        }
        #[derive(serde::Deserialize)]
        struct Fixture {
            cases: Vec<Case>,
        }
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/json/json-dumps.json"
        );
        let fixture: Fixture = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        assert!(fixture.cases.len() > 100, "{path}: {}", fixture.cases.len());
        for c in &fixture.cases {
            let (text, map) = (c.text.as_deref(), Some(&c.weight_map[..]));
            for (sort_keys, want) in [(false, &c.index), (true, &c.index_sorted)] {
                let got = index(text, c.total, map, sort_keys, None);
                assert_eq!(got.as_ref(), Ok(want), "{text:?} sorted {sort_keys}");
            }
            if let (Some(text), Some(want)) = (text, &c.config) {
                let got = config_text(text, Target::Bf16, true, None);
                assert_eq!(got, Ok(Some(want.clone())), "{text:?}");
            }
        }
    }

    #[test]
    fn index_text_keeps_the_source_s_other_members() {
        let src = "{\"weight_map\": {\"old\": \"x\"}, \"metadata\": {\"total_size\": 1, \"p\": 3}, \"z\": 1}";
        let map = vec![
            ("b".to_string(), "s2".to_string()),
            ("a".to_string(), "s1".to_string()),
        ];
        assert_eq!(
            index_text(Some(src), 9, &map, false).unwrap(),
            "{\n  \"weight_map\": {\n    \"b\": \"s2\",\n    \"a\": \"s1\"\n  },\n  \"metadata\": {\n    \
             \"total_size\": 9,\n    \"p\": 3\n  },\n  \"z\": 1\n}\n"
        );
        assert_eq!(
            index_text(None, 9, &map, true).unwrap(),
            "{\n  \"metadata\": {\n    \"total_size\": 9\n  },\n  \"weight_map\": {\n    \"a\": \"s1\",\n    \
             \"b\": \"s2\"\n  }\n}\n"
        );
    }

    #[test]
    fn configs_lose_or_gain_their_quantization() {
        let t = "{\"quantization_config\": {}, \"compression_config\": 1, \"torch_dtype\": \"float32\"}\n";
        assert_eq!(
            config_text(t, Target::Bf16, true, None).unwrap().unwrap(),
            "{\n  \"torch_dtype\": \"bfloat16\"\n}\n"
        );
        let one_line = config_text(t.trim_end(), Target::Bf16, true, None)
            .unwrap()
            .unwrap();
        assert_eq!(one_line, "{\"torch_dtype\": \"bfloat16\"}");
        assert_eq!(config_text(t, Target::Keep, false, None).unwrap(), None);
        let fp8 = config_text(
            "{\"z\": 1, \"dtype\": \"float32\"}",
            Target::Fp8,
            false,
            Some(&["lm_head".into(), "Norm".into()]),
        )
        .unwrap()
        .unwrap();
        assert!(
            fp8.starts_with("{\n  \"dtype\": \"bfloat16\",\n  \"quantization_config\": {\n"),
            "{fp8}"
        );
        assert!(
            fp8.contains("\"ignore\": [\n      \"lm_head\",\n      \"re:Norm\\\\Z\"\n    ]"),
            "{fp8}"
        );
        assert!(
            fp8.contains("\"FP8_DYNAMIC\"") && fp8.ends_with("  \"z\": 1\n}\n"),
            "{fp8}"
        );
        // An older tool's `compression_config` goes: one description of the weights.
        let old = "{\"compression_config\": {\"format\": \"pack-quantized\"}}";
        let fp8 = config_text(old, Target::Fp8, false, Some(&[]))
            .unwrap()
            .unwrap();
        assert!(!fp8.contains("compression_config") && fp8.contains("FP8_DYNAMIC"));
        let block = config_text("{}", Target::Fp8Block, false, Some(&[]))
            .unwrap()
            .unwrap();
        assert!(block
            .contains("\"block_structure\": [\n            128,\n            128\n          ],"));
        assert_eq!(ignore_entry("re:a.b"), "re:re:a\\.b\\Z");
        assert_eq!(ignore_entry("model.Norm"), "model.Norm");
    }

    #[test]
    fn schemes_of_a_config() {
        let t = r#"{"quantization_config": {"quant_method": "compressed-tensors",
            "format": "pack-quantized", "config_groups": {
            "a": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                  "strategy": "group", "group_size": 128, "symmetric": true}},
            "b": {"format": "int-quantized", "weights": {"num_bits": 8, "symmetric": false,
                  "group_size": null}},
            "c": {"input_activations": {"num_bits": 8}}}}}"#;
        let (s, ignore) = schemes(t).unwrap();
        assert_eq!(s.len(), 2);
        assert!(ignore.is_empty());
        assert_eq!(
            (&s[0].targets[..], s[1].targets.len()),
            (&["Linear".to_string()][..], 0)
        );
        assert_eq!(s[0].format.as_deref(), Some("pack-quantized"));
        assert_eq!(
            (s[0].num_bits, s[0].group_size, s[0].symmetric),
            (Some(4), Some(128), Some(true))
        );
        assert_eq!(s[0].strategy.as_deref(), Some("group"));
        assert_eq!(s[1].format.as_deref(), Some("int-quantized"));
        assert_eq!(
            (s[1].group_size, s[1].symmetric, s[1].kind.clone()),
            (None, Some(false), None)
        );
        let mixed = t.replace("\"pack-quantized\"", "\"mixed-precision\"");
        assert_eq!(schemes(&mixed).unwrap().0[0].format, None);
        let ignored = t.replace(
            "\"format\": \"pack",
            "\"ignore\": [\"lm_head\", 3], \"format\": \"pack",
        );
        assert_eq!(schemes(&ignored).unwrap().1, ["lm_head"]);
        let other = r#"{"quantization_config": {"quant_method": "mxfp4"}}"#;
        assert!(schemes(other).unwrap().0.is_empty());
        assert!(schemes("{}").unwrap().0.is_empty());
        assert!(schemes("{").is_err());
    }
}
