//! Enums whose variants each carry a stable name (a state shown in SQL, a
//! metric label) and, where they need one, a help text: one line per
//! variant, so that a new state, reason or counter cannot fall out of step
//! with a list kept elsewhere.

/// Declares the enum and `ALL`, `COUNT`, `name()`, `help()` and `index()`:
///
/// ```
/// outbox_core::named! {
///     /// Where a wake came from.
///     pub enum Source {
///         Commit = "commit" => "A transaction that inserted events committed.",
///         Poll = "poll",
///     }
/// }
/// assert_eq!(Source::ALL, [Source::Commit, Source::Poll]);
/// assert_eq!(Source::Poll.name(), "poll");
/// assert_eq!(Source::Commit.help(), "A transaction that inserted events committed.");
/// assert_eq!(Source::Poll.index(), 1);
/// ```
#[macro_export]
macro_rules! named {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $( $(#[$variant_meta:meta])* $variant:ident = $label:literal $(=> $help:literal)? ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u8)]
        $vis enum $name {
            $( $(#[$variant_meta])* $variant ),+
        }

        #[allow(dead_code)]
        impl $name {
            /// Every variant, in declaration order (`index()` is the position).
            pub const ALL: [$name; [$( $label ),+].len()] = [$( $name::$variant ),+];
            pub const COUNT: usize = Self::ALL.len();

            /// The stable name.
            pub fn name(self) -> &'static str {
                match self {
                    $( $name::$variant => $label ),+
                }
            }

            /// The help text, empty when none was given.
            pub fn help(self) -> &'static str {
                match self {
                    $( $name::$variant => concat!("" $(, $help)?) ),+
                }
            }

            /// The position in `ALL`.
            pub fn index(self) -> usize {
                self as usize
            }
        }
    };
}
