//! Output names and the option values that make them: shard and index file names, the
//! stem a user may give (`name`), sizes (`max_shard_size`), and input tensor names stripped
//! of the prefixes a user gives (`strip_prefix`). A leaf: it uses no other
//! module, so the option checks (`vocab`) and the re-sharding (`shard`) both ask it.

/// `(folder, name)` of a relative path, `/`-separated (`folder` empty at the top).
pub fn split_rel(rel: &[u8]) -> (&[u8], &[u8]) {
    match rel.iter().rposition(|&c| c == b'/') {
        Some(at) => (&rel[..at], &rel[at + 1..]),
        None => (&[], rel),
    }
}

/// What a size option says, in bytes: a number (maybe with a decimal point) and an optional
/// unit, case-insensitive: B; KB, MB, GB, TB (powers of 1000); KiB, MiB, GiB, TiB (powers
/// of 1024). A lowercase `b` means bytes, never bits. Fractions of a byte round down; None
/// for anything else, zero, or more than 64 bits hold.
pub fn parse_size(text: &str) -> Option<u64> {
    let s = text.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let multiplier: u128 = match unit.trim_start().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => return None,
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    let digits = format!("{whole}{fraction}");
    // 20 digits keep every product below u128::MAX; more is no size anyone means.
    if digits.is_empty() || digits.len() > 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let mantissa: u128 = digits.parse().ok()?;
    let bytes = mantissa * multiplier / 10u128.pow(fraction.len() as u32);
    u64::try_from(bytes).ok().filter(|&b| b > 0)
}

/// The file name of output shard `i` (1-based) of `n` of a group with stem `stem`, as
/// transformers writes them: `model-00001-of-00003.safetensors`, or `model.safetensors`
/// when there is one.
pub fn shard_file_name(stem: &str, i: usize, n: usize) -> String {
    if n == 1 {
        return format!("{stem}.safetensors");
    }
    let w = n.to_string().len().max(5);
    format!("{stem}-{i:0w$}-of-{n:0w$}.safetensors")
}

/// Is the file name `name` the weights (a lone file or a shard) or the index of a
/// checkpoint whose stem `has` (`model` for `model.safetensors`,
/// `model-00001-of-00003.safetensors` and `model.safetensors.index.json`)?
pub fn names_output(name: &[u8], has: impl Fn(&[u8]) -> bool) -> bool {
    if let Some(stem) = name.strip_suffix(b".safetensors.index.json") {
        return has(stem);
    }
    let Some(base) = name.strip_suffix(b".safetensors") else {
        return false;
    };
    has(base) || split_shard(base).is_some_and(|(stem, _, _)| has(stem))
}

/// The stem and numbers of a shard name as `shard_file_name` writes them, its extension
/// taken off and any number of digits: `("model", "00001", "00003")` for
/// `model-00001-of-00003`. None for a name without that suffix. The one reader of shard
/// names: a folder walk groups shards by it, a re-sharding finds its earlier outputs. Over
/// the bytes of a name (a file name need not be UTF-8).
pub fn split_shard(s: &[u8]) -> Option<(&[u8], &[u8], &[u8])> {
    let digits = |s: &[u8]| {
        s.iter()
            .rposition(|c| !c.is_ascii_digit())
            .map_or(0, |p| p + 1)
    };
    let (rest, n) = s.split_at(digits(s));
    let rest = rest.strip_suffix(b"-of-").filter(|_| !n.is_empty())?;
    let (rest, i) = rest.split_at(digits(rest));
    Some((rest.strip_suffix(b"-").filter(|_| !i.is_empty())?, i, n))
}

/// The index file of a group with stem `stem`: `model.safetensors.index.json`.
pub fn index_file_name(stem: &str) -> String {
    format!("{stem}.safetensors.index.json")
}

/// What a stem given for the output (the `name` option) must be.
pub const STEM_EXPECTED: &str =
    "a file name stem (e.g. model): not empty, not starting with `-` or `.`, without `/`, control \
     characters, surrounding spaces or a `.safetensors` ending, at most 228 bytes";

/// The longest stem whose names fit in a file name of 255 bytes (NAME_MAX on Linux, macOS
/// and Windows): the shard suffix `-00001-of-00001.safetensors` takes 27.
pub const MAX_STEM_BYTES: usize = 255 - 27;

/// Is `stem` fit to name output shards (the `name` option)? One file name component, so
/// that `shard_file_name` and `index_file_name` stay in their group's folder, refused before
/// anything is written: what would fail at publish (too long), escape the folder (`/`,
/// `..`), hide the files (`.x`), read as an option (`-x`), break a listing (control
/// characters, spaces at either end) or double the extension (`m.safetensors`).
pub fn is_stem(stem: &str) -> bool {
    !(stem.is_empty()
        || stem.len() > MAX_STEM_BYTES
        || stem.starts_with(['-', '.'])
        || stem.contains('/')
        || stem.chars().any(char::is_control)
        || stem.trim() != stem
        || stem.to_ascii_lowercase().ends_with(".safetensors"))
}

/// `name` once each of `prefixes` is dropped in turn, each from what the one before left:
/// `module.` then `_orig_mod.` make `module._orig_mod.x` into `x`. A prefix the rest does
/// not start with, or that is the whole rest (a name is never emptied), is passed over.
/// `dropped(i)` is told of each prefix `i` dropped.
pub fn strip_prefixes_marking<'a>(
    name: &'a str,
    prefixes: &[String],
    mut dropped: impl FnMut(usize),
) -> &'a str {
    let mut rest = name;
    for (i, p) in prefixes.iter().enumerate() {
        if let Some(r) = rest.strip_prefix(p.as_str()).filter(|r| !r.is_empty()) {
            rest = r;
            dropped(i);
        }
    }
    rest
}

/// `name` stripped of `prefixes` in turn (`strip_prefixes_marking`).
pub fn strip_prefixes<'a>(name: &'a str, prefixes: &[String]) -> &'a str {
    strip_prefixes_marking(name, prefixes, |_| {})
}

/// The prefixes of `prefixes` that no name of `names` drops (`strip_prefixes`): each a
/// warning (a typo, or an order that never reaches it), in the order given.
pub fn unused_prefixes<'n>(
    names: impl IntoIterator<Item = &'n str>,
    prefixes: &[String],
) -> Vec<String> {
    if prefixes.is_empty() {
        return Vec::new();
    }
    let mut used = vec![false; prefixes.len()];
    for name in names {
        strip_prefixes_marking(name, prefixes, |i| used[i] = true);
    }
    prefixes
        .iter()
        .zip(used)
        .filter(|(_, used)| !used)
        .map(|(p, _)| p.clone())
        .collect()
}

/// The first two of `n` names (`name(i)`) that are one: the pair whose second comes first,
/// as `(first, second)`. Found by sorting indices by name rather than by a map of every
/// name (500k tensors: some 50 MB), so that a name may be made on each call (stripped).
pub fn first_repeat<'a>(n: usize, name: impl Fn(usize) -> &'a str) -> Option<(usize, usize)> {
    let mut order: Vec<u32> = (0..n as u32).collect();
    order.sort_unstable_by(|&a, &b| name(a as usize).cmp(name(b as usize)).then(a.cmp(&b)));
    order
        .windows(2)
        .filter(|w| name(w[0] as usize) == name(w[1] as usize))
        .map(|w| (w[0] as usize, w[1] as usize))
        .min_by_key(|&(_, second)| second)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn prefixes_are_dropped_in_turn() {
        let both = p(&["module.", "_orig_mod."]);
        assert_eq!(strip_prefixes("module._orig_mod.x", &both), "x");
        assert_eq!(strip_prefixes("_orig_mod.x", &both), "x");
        assert_eq!(strip_prefixes("module.x", &both), "x");
        // In the order given: the second is not tried before the first.
        assert_eq!(strip_prefixes("_orig_mod.module.x", &both), "module.x");
        // Never emptied; each prefix at most once.
        assert_eq!(strip_prefixes("module.", &both), "module.");
        assert_eq!(strip_prefixes("module.module.x", &both), "module.x");
        assert_eq!(
            unused_prefixes(["module.a", "module.b"], &both),
            vec!["_orig_mod.".to_string()]
        );
        assert!(unused_prefixes(["module._orig_mod.a"], &both).is_empty());
        assert!(unused_prefixes(["a"], &[]).is_empty());
    }

    #[test]
    fn the_first_repeat_is_found() {
        let names = ["module.a", "b", "a", "b"];
        let pre = p(&["module."]);
        assert_eq!(first_repeat(4, |i| names[i]), Some((1, 3)));
        assert_eq!(
            first_repeat(4, |i| strip_prefixes(names[i], &pre)),
            Some((0, 2))
        );
        assert_eq!(first_repeat(2, |i| names[i]), None);
        assert_eq!(first_repeat(0, |i| names[i]), None);
    }

    #[test]
    fn sizes_parse_with_units_decimals_and_any_case() {
        let cases: &[(&str, u64)] = &[
            ("5GB", 5_000_000_000),
            ("5gb", 5_000_000_000),
            ("5 GB", 5_000_000_000),
            ("5Gb", 5_000_000_000),
            ("1.5GiB", 3 << 29),
            ("0.5kb", 500),
            (".5KiB", 512),
            ("2.", 2),
            ("1234", 1234),
            ("1234b", 1234),
            ("1TiB", 1 << 40),
            ("1tb", 1_000_000_000_000),
            ("3MiB", 3 << 20),
            ("1.0001KB", 1000),
            ("18446744073709551615", u64::MAX),
        ];
        for (text, want) in cases {
            assert_eq!(parse_size(text), Some(*want), "{text}");
        }
        for bad in [
            "",
            "GB",
            ".",
            "5XB",
            "5 G",
            "5g",
            "-1",
            "1e9",
            "0",
            "0.1B",
            "1.2.3",
            "5 GB B",
            "18446744073709551616",
            "99999999999999999999999",
            "5 bits",
            "+5",
        ] {
            assert_eq!(parse_size(bad), None, "{bad:?}");
        }
        assert_eq!(parse_size(" 5 gib "), Some(5 << 30));
    }

    #[test]
    fn names_are_those_transformers_writes() {
        assert_eq!(shard_file_name("model", 1, 1), "model.safetensors");
        assert_eq!(
            shard_file_name("model", 2, 3),
            "model-00002-of-00003.safetensors"
        );
        assert_eq!(
            shard_file_name("ema", 7, 123_456),
            "ema-000007-of-123456.safetensors"
        );
        assert_eq!(index_file_name("ema"), "ema.safetensors.index.json");
    }

    #[test]
    fn stems_are_one_file_name_component() {
        for good in [
            "model",
            "ema",
            "a.b",
            "model-00001-of-00002",
            "é",
            "my model",
            &"x".repeat(MAX_STEM_BYTES),
        ] {
            assert!(is_stem(good), "{good:?}");
        }
        let long = "x".repeat(MAX_STEM_BYTES + 1);
        let bad_stems = [
            "",
            ".",
            "..",
            "...",
            ".hidden",
            "a/b",
            "/",
            "x/",
            "/x",
            "a\0b",
            "\0",
            "-x",
            "--x",
            " ",
            " x",
            "x ",
            "a\nb",
            "a\tb",
            "m.safetensors",
            "M.SafeTensors",
            &long,
        ];
        for bad in bad_stems {
            assert!(!is_stem(bad), "{bad:?}");
        }
    }
}
