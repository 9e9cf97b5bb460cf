//! `[evolution]` configuration: defined with every role's settings in `quantmesh-settings`
//! (so the file is checked as a whole at load), re-exported here.

pub use quantmesh_settings::evolution::EvolutionSettings;
