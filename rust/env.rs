//! The one place that reads the process environment.
//!
//! The engine takes every setting as an argument (`convert::Options`, `plan::PlanOptions`);
//! the only variable it reads is `STCAST_FAILPOINT`, the test hook of `failpoint`.

use std::sync::OnceLock;

/// `STCAST_FAILPOINT=NAME=ACTION[,NAME=ACTION...]` as (name, action) pairs, read once.
pub fn failpoints() -> &'static [(String, String)] {
    static POINTS: OnceLock<Vec<(String, String)>> = OnceLock::new();
    POINTS.get_or_init(|| {
        std::env::var("STCAST_FAILPOINT")
            .unwrap_or_default()
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
            .collect()
    })
}
