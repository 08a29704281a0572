//! The checkout's files as the tests read them: paths in it, their text.

use std::path::{Path, PathBuf};

/// `rel` in the checkout (this crate is its `tests/support`).
pub fn repo(rel: &str) -> PathBuf {
    let support = Path::new(env!("CARGO_MANIFEST_DIR"));
    support.ancestors().nth(2).expect("tests/support sits two folders below the checkout").join(rel)
}

/// The text of `rel` in the checkout.
pub fn read_repo(rel: &str) -> String {
    std::fs::read_to_string(repo(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// A path on disk as a `&str` (temp dirs and the checkout are UTF-8 here).
pub fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}
