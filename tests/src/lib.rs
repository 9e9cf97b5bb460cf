//! Helpers for quantmesh's end-to-end tests: start the real embedded server on a free
//! loopback port, talk real HTTP to it.
