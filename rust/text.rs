//! Message text: templates that name options neutrally, sizes, counts and lists.
//!
//! Engine messages never spell a CLI flag or a Python keyword. Where one refers to an
//! option it writes a placeholder, `{force}` or `{on_overflow=keep}`, naming it by its
//! `vocab::OptionName`; each front end renders placeholders its own way (`--force`,
//! `force=True`). Data put into a message (paths, tensor names) is escaped with `esc`, so
//! that a name holding braces is never taken for a placeholder: `{{` and `}}` stand for
//! literal braces. A brace that starts no valid placeholder is kept as it is.

use std::borrow::Cow;
use std::fmt::Write;
use std::path::Path;

use crate::vocab::OptionName;

/// `s` with its braces doubled, for use inside a template.
pub fn esc(s: &str) -> Cow<'_, str> {
    if s.contains(['{', '}']) {
        Cow::Owned(s.replace('{', "{{").replace('}', "}}"))
    } else {
        Cow::Borrowed(s)
    }
}

/// A path for a template: `Path::display`, escaped.
pub fn esc_path(p: &Path) -> String {
    esc(&p.display().to_string()).into_owned()
}

/// One placeholder of a template: an option and, for `{name=value}`, its value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placeholder<'a> {
    pub option: OptionName,
    pub value: Option<&'a str>,
}

/// Render `template`, replacing each placeholder by `option(placeholder)`.
pub fn render(template: &str, mut option: impl FnMut(Placeholder<'_>) -> String) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(at) = rest.find(['{', '}']) {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        if tail.starts_with("{{") || tail.starts_with("}}") {
            out.push_str(&tail[..1]);
            rest = &tail[2..];
            continue;
        }
        if let Some((p, len)) = placeholder(tail) {
            out.push_str(&option(p));
            rest = &tail[len..];
        } else {
            out.push_str(&tail[..1]);
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    out
}

/// The placeholder `tail` starts with, and its length in bytes.
fn placeholder(tail: &str) -> Option<(Placeholder<'_>, usize)> {
    let body = tail.strip_prefix('{')?;
    let end = body.find('}')?;
    let inner = &body[..end];
    let (name, value) = match inner.split_once('=') {
        Some((n, v)) => (n, Some(v)),
        None => (inner, None),
    };
    let option = OptionName::from_name(name)?;
    // Values are static words of the engine's hints: no spaces, no braces.
    let plain = |s: &str| !s.is_empty() && !s.contains(|c: char| c.is_whitespace() || c == '{');
    if value.is_some_and(|v| !plain(v)) {
        return None;
    }
    Some((Placeholder { option, value }, end + 2))
}

/// The neutral rendering, for Rust callers and logs: `force`, `on_overflow=keep`.
pub fn plain(template: &str) -> String {
    render(template, |p| match p.value {
        Some(v) => format!("{}={v}", p.option.name()),
        None => p.option.name().to_string(),
    })
}

/// Bytes in decimal units with three significant digits: 950 B, 12.3 kB, 4.56 GB. The one
/// unit system of every message and summary (`_core.format_bytes` in Python).
pub fn format_bytes(n: u64) -> String {
    if n < 1000 {
        return format!("{n} B");
    }
    let mut v = n as f64;
    let mut unit = "B";
    for u in ["kB", "MB", "GB", "TB", "PB"] {
        v /= 1000.0;
        unit = u;
        if v < 999.5 {
            break;
        }
    }
    let digits = if v < 9.995 {
        2
    } else if v < 99.95 {
        1
    } else {
        0
    };
    format!("{v:.digits$} {unit}")
}

/// The SHA-256 of `bytes`, as lower-case hex (an output header's fingerprint).
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(bytes);
    let mut out = String::with_capacity(64);
    for b in digest {
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// "1 tensor", "3 weights".
pub fn count(n: u64, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

/// "`a`, `b`, `c` and 3 more": at most `shown` names, quoted and escaped.
pub fn name_list<'a>(names: impl IntoIterator<Item = &'a str>, shown: usize) -> String {
    let mut out = String::new();
    let mut more = 0usize;
    for (i, n) in names.into_iter().enumerate() {
        if i < shown {
            if i > 0 {
                out.push_str(", ");
            }
            let _ = write!(out, "`{}`", esc(n));
        } else {
            more += 1;
        }
    }
    if more > 0 {
        let _ = write!(out, " and {more} more");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_render_and_data_stays_literal() {
        let t = format!(
            "tensor `{}` and {{force}} ({{on_overflow=keep}} or {{keep}})",
            esc("a{force}b")
        );
        assert_eq!(
            t,
            "tensor `a{{force}}b` and {force} ({on_overflow=keep} or {keep})"
        );
        assert_eq!(
            plain(&t),
            "tensor `a{force}b` and force (on_overflow=keep or keep)"
        );
        // Any renderer gets each placeholder's option and value (the CLI's flags are
        // rendered and tested on the Python side, tests/test_api.py).
        let tagged = render(&t, |p| match p.value {
            Some(v) => format!("<{}:{v}>", p.option.name()),
            None => format!("<{}>", p.option.name()),
        });
        assert_eq!(
            tagged,
            "tensor `a{force}b` and <force> (<on_overflow:keep> or <keep>)"
        );
        // Not placeholders: unknown names, odd values, lone braces.
        for s in ["{nope}", "{force=a b}", "{", "}", "{force", "x{}y"] {
            assert_eq!(plain(s), s);
        }
    }

    #[test]
    fn decimal_sizes() {
        let cases = [
            (0, "0 B"),
            (999, "999 B"),
            (1000, "1.00 kB"),
            (12_345, "12.3 kB"),
            (999_499, "999 kB"),
            (999_500, "1.00 MB"),
            (4_560_000_000, "4.56 GB"),
            (u64::MAX, "18447 PB"),
        ];
        for (n, want) in cases {
            assert_eq!(format_bytes(n), want, "{n}");
        }
    }

    #[test]
    fn lists_and_counts() {
        assert_eq!(name_list(["a", "b"], 5), "`a`, `b`");
        assert_eq!(name_list(["a", "b", "c"], 1), "`a` and 2 more");
        assert_eq!(count(1, "tensor"), "1 tensor");
        assert_eq!(count(2, "tensor"), "2 tensors");
    }
}
