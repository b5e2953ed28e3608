//! fnmatch patterns (`keep`, `include`, `exclude`): compiled once, matched as Python's
//! `fnmatch.fnmatchcase` matches.

use crate::error::{Error, Result};

/// fnmatch patterns (`keep`, `include`, `exclude`), compiled; a bad one is `option`'s error.
pub fn compile_globs(
    patterns: &[String],
    option: crate::vocab::OptionName,
) -> Result<Vec<glob::Pattern>> {
    patterns
        .iter()
        .map(|p| {
            glob::Pattern::new(&collapse_stars(p)).map_err(|e| Error::BadPattern {
                option,
                pattern: p.clone(),
                reason: e.msg.to_string(),
            })
        })
        .collect()
}

/// Does `p` match `name` as fnmatch does (`*` and `?` match any character, dots and slashes
/// included; case-sensitive)?
pub fn glob_matches(p: &glob::Pattern, name: &str) -> bool {
    let opts = glob::MatchOptions {
        case_sensitive: true,
        require_literal_separator: false,
        require_literal_leading_dot: false,
    };
    p.matches_with(name, opts)
}

/// `**` means `*` in fnmatch, but the glob crate takes it for a recursive path wildcard
/// (and refuses it inside a name). Inside `[...]` a repeated `*` names the same set, so
/// collapsing every run keeps the meaning.
fn collapse_stars(pattern: &str) -> String {
    let mut out = String::with_capacity(pattern.len());
    for c in pattern.chars() {
        if !(c == '*' && out.ends_with('*')) {
            out.push(c);
        }
    }
    out
}
