//! Output names and the option values that make them: shard and index file names, the
//! stem a user may give (`name`), and sizes (`max_shard_size`). A leaf: it uses no other
//! module, so the option checks (`vocab`) and the re-sharding (`shard`) both ask it.

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

/// The stem and numbers of a shard name as `shard_file_name` writes them, its extension
/// taken off and any number of digits: `("model", "00001", "00003")` for
/// `model-00001-of-00003`. None for a name without that suffix. The one reader of shard
/// names: a folder walk groups shards by it, a re-sharding finds its earlier outputs.
pub fn split_shard_name(name: &str) -> Option<(&str, &str, &str)> {
    // `name` is split at ASCII bytes, so on character boundaries.
    let (stem, i, n) = split_shard(name.as_bytes())?;
    let n_at = name.len() - n.len();
    let i_at = n_at - "-of-".len() - i.len();
    Some((
        &name[..stem.len()],
        &name[i_at..n_at - "-of-".len()],
        &name[n_at..],
    ))
}

/// `split_shard_name` over the bytes of a name (a file name need not be UTF-8).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_names_read_back_as_written() {
        for (i, n) in [(2, 3), (7, 123_456)] {
            let name = shard_file_name("a-1-of-2", i, n);
            let bare = name.strip_suffix(".safetensors").unwrap();
            let (stem, got_i, got_n) = split_shard_name(bare).unwrap();
            assert_eq!(
                (stem, got_i.parse(), got_n.parse()),
                ("a-1-of-2", Ok(i), Ok(n))
            );
        }
        assert_eq!(split_shard_name("-1-of-2"), Some(("", "1", "2")));
        assert_eq!(split_shard_name("a-12-of-003"), Some(("a", "12", "003")));
        for other in [
            "a-of-2",
            "a-1-of-",
            "a1-of-2",
            "a-1-of-2x",
            "a-1-0f-2",
            "model",
            "",
        ] {
            assert_eq!(split_shard_name(other), None, "{other}");
        }
    }
}
