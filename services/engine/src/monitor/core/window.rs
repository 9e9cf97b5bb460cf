//! The monitor's windows: the decisions taken when one closes (per group with hysteresis,
//! then MLP coupling and the batch flag), from the evidence gathered while it ran.

use super::*;

/// One group's counts in the window that closes, for its event.
#[derive(Debug, Clone, Copy, Default)]
struct Counted {
    tokens: u64,
    outliers: u64,
    wanted_unavailable: bool,
    mean_nsr: Option<f64>,
}

impl Monitor {
    /// Close the current window: decide per group, then the batch flag.
    pub fn end_window(&mut self) -> Vec<FallbackEvent> {
        self.windows += 1;
        self.requests_in_window = 0;
        let mut events = Vec::new();
        let ids: Vec<GroupId> = self.groups.keys().copied().collect();
        let mut counted: BTreeMap<GroupId, Counted> = BTreeMap::new();
        for g in ids {
            let Some(s) = self.groups.get_mut(&g) else {
                continue;
            };
            let decided = s.ready && s.window_tokens >= self.cfg.min_window_tokens;
            let rate = if s.window_tokens > 0 {
                s.window_outliers as f64 / s.window_tokens as f64
            } else {
                0.0
            };
            // Enter only when the rate is above the trigger with confidence: a one-sided
            // binomial test of "true rate ≤ trigger" (normal approximation, `trigger_z` σ).
            let n = s.window_tokens as f64;
            let margin = self.cfg.trigger_z * (s.trigger * (1.0 - s.trigger) / n.max(1.0)).sqrt();
            let above = rate > s.trigger + margin;
            let mean_nsr =
                (s.window_harm_rows > 0).then(|| s.window_harm / s.window_harm_rows as f64);
            counted.insert(
                g,
                Counted {
                    tokens: s.window_tokens,
                    outliers: s.window_outliers,
                    // (a split group too: it wanted float, and the weekly analysis weighs a copy)
                    wanted_unavailable: decided && above && !s.residency.has_float(),
                    mean_nsr,
                },
            );
            if decided {
                s.last_rate = Some(rate);
                if mean_nsr.is_some() {
                    s.last_nsr = mean_nsr;
                }
            }
            s.window_harm = 0.0;
            s.window_harm_rows = 0;
            s.window_tokens = 0;
            s.window_outliers = 0;
            if s.ready {
                s.token_bound = s.bound(self.cfg.token_k) as f32;
            }
            if !decided {
                continue;
            }
            let mut ev = None;
            match s.mode {
                GroupMode::Int8 if above => {
                    if s.can_fall_back() {
                        // onto the float copy (`enter`), or 16-bit activations (`split`)
                        s.mode = GroupMode::Fallback;
                        s.quiet = 0;
                        s.reason = Some(FallbackReason::OutlierRate);
                        ev = Some((s.fallback_action(), FallbackReason::OutlierRate));
                    } else {
                        s.wanted_unavailable = true;
                        s.reason = Some(FallbackReason::OutlierRate);
                        ev = Some((FallbackAction::Unavailable, FallbackReason::OutlierRate));
                    }
                }
                GroupMode::Fallback => {
                    if rate < s.trigger / 2.0 {
                        s.quiet += 1;
                        if s.quiet >= self.cfg.recovery_windows {
                            s.mode = GroupMode::Int8;
                            s.quiet = 0;
                            s.reason = Some(FallbackReason::Recovered);
                            ev = Some((FallbackAction::Exit, FallbackReason::Recovered));
                        }
                    } else {
                        s.quiet = 0;
                    }
                }
                _ => {}
            }
            if let Some((action, reason)) = ev {
                let e = self.event(Some(g), Granularity::Layer, action, reason);
                tracing::info!(group = %g, ?action, ?reason, rate, "layer fallback decision");
                events.push(e);
            }
        }
        events.extend(self.couple_mlp());
        let share = self.groups.values().filter(|s| s.in_float()).count() as f64
            / self.groups.len().max(1) as f64;
        let want_batch = share > self.cfg.batch_group_share;
        if want_batch != self.batch_float {
            self.batch_float = want_batch;
            let action = if want_batch {
                FallbackAction::Enter
            } else {
                FallbackAction::Exit
            };
            events.push(self.event(None, Granularity::Batch, action, FallbackReason::LayerShare));
        }
        self.close_window(&counted);
        events
    }

    /// Turn the window's evidence into its event and start the next window.
    fn close_window(&mut self, counted: &BTreeMap<GroupId, Counted>) {
        let ev = std::mem::replace(&mut self.window, WindowEvidence::new());
        let end = self.window.started_ms;
        let groups = self
            .groups
            .iter()
            .map(|(g, s)| {
                let c = counted.get(g).copied().unwrap_or_default();
                WindowGroup {
                    group: g.to_string(),
                    tokens: c.tokens,
                    outliers: c.outliers,
                    in_float: s.on_float_copy(),
                    wanted_unavailable: c.wanted_unavailable,
                    residency: wire_name(&s.residency),
                    mean_nsr: c.mean_nsr,
                }
            })
            .collect();
        self.closed_windows.push(WindowEvent {
            schema_version: WINDOW_EVENT_SCHEMA_VERSION,
            event_id: uuid_v4(),
            timestamp_ms: end,
            duration_ms: end.saturating_sub(ev.started_ms),
            model: self.model.clone(),
            window: self.windows,
            config_md5: self.config_md5.clone(),
            groups,
            shadow_kl: ev.kl,
            shadow_kl_seen: ev.kl_seen,
            kl_reference: ev.kl_reference,
            request_kl_fallbacks: ev.request_kl_fallbacks,
        });
    }

    /// `gate_up` follows its layer's `down` in and out of an automatic fallback.
    fn couple_mlp(&mut self) -> Vec<FallbackEvent> {
        let mut events = Vec::new();
        let layers: Vec<usize> = self
            .groups
            .keys()
            .map(|g| g.layer)
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        for l in layers {
            let down = GroupId::new(l, quantmesh_types::GroupKind::Down);
            let gu = GroupId::new(l, quantmesh_types::GroupKind::GateUp);
            let down_auto_float = self
                .groups
                .get(&down)
                .is_some_and(|s| s.mode == GroupMode::Fallback && s.in_float());
            let Some(g) = self.groups.get_mut(&gu) else {
                continue;
            };
            let change = match (g.mode, down_auto_float) {
                (GroupMode::Int8, true) if g.can_fall_back() => Some((
                    GroupMode::Coupled,
                    g.fallback_action(),
                    FallbackReason::OutlierRate,
                )),
                (GroupMode::Coupled, false) => Some((
                    GroupMode::Int8,
                    FallbackAction::Exit,
                    FallbackReason::Recovered,
                )),
                _ => None,
            };
            if let Some((mode, action, reason)) = change {
                g.mode = mode;
                g.reason = Some(reason);
                events.push(self.event(Some(gu), Granularity::Layer, action, reason));
            }
        }
        events
    }
}
