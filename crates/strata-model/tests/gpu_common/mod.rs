//! Helpers shared by the GPU test files.
//! Each test binary includes this module with `mod gpu_common;`.

/// The index of the largest logit (the first on ties).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}
