//! The `label_enum!` macro: a metric label's bounded values as an enum, each with its label
//! string, and `ALL` in declaration order. Declared before every module (`#[macro_use]`),
//! so a room that decides a label value can own its enum without importing `metrics`.

/// Declares a label enum: variants, their label strings, and `ALL` in declaration order
/// (so `variant as usize` indexes `ALL` and the per-route handle tables).
macro_rules! label_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $label:literal,)+ }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [Self] = &[$(Self::$variant,)+];

            /// The label value.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $label,)+
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}
