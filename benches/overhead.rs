//! Placeholder; replaced by the overhead benchmark.
fn main() {}
