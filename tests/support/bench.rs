//! What the benches share: prompts of a chosen size and numbers for their tables.

/// `n` deterministic lowercase words of 3–7 letters (about 6 bytes each with the space), for
/// prompts of a chosen size.
pub fn words(n: usize, seed: u64) -> String {
    let mut state = seed | 1;
    let mut text = String::with_capacity(n * 7);
    for i in 0..n {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        if i > 0 {
            text.push(' ');
        }
        for k in 0..3 + (state % 5) as usize {
            text.push(char::from(b'a' + ((state >> (8 + 5 * k)) % 26) as u8));
        }
    }
    text
}

/// A number for a bench table: 3 significant-ish places (`0.42`, `12.3`, `456`), `–` for NaN.
pub fn fmt_num(v: f64) -> String {
    if v.is_nan() {
        "–".into()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// [`fmt_num`] with its sign always shown (`+0.42`, `-1.10`).
pub fn fmt_signed(v: f64) -> String {
    if v >= 0.0 {
        format!("+{}", fmt_num(v))
    } else {
        fmt_num(v)
    }
}
