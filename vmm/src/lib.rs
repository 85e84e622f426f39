//! The Musubi VMM.
