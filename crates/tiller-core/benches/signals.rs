//! Signals per second through the turn core: a turn's typical stream
//! (prompt, updates, a tool batch, result) and a steered turn.
//! Run: `cargo bench -p tiller-core --bench signals`.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;
use tiller_core::{
    IdleBehavior, Input, Origin, PromptId, SessionCore, Signal, SteerId, SteerReceipt, StopReason,
    TurnConfig, TurnId,
};

const UPDATES: u64 = 1_000;

fn plain_turns(c: &mut Criterion) {
    let mut g = c.benchmark_group("core");
    // Signals per turn: UPDATES updates + 1 result.
    g.throughput(Throughput::Elements(UPDATES + 1));
    g.bench_function("plain turn (1000 updates + result)", |b| {
        let mut core: SessionCore = SessionCore::new(TurnConfig::default(), 0);
        let mut now = 0;
        b.iter(|| {
            now += 1;
            core.on(
                now,
                Input::Prompt {
                    prompt: PromptId::from_u128(now as u128),
                    origin: Origin::Interactive,
                    payload: (),
                },
            );
            let turn = core.last_turn();
            for _ in 0..UPDATES {
                black_box(core.on(
                    now,
                    Input::Signal {
                        turn,
                        signal: Signal::Update,
                    },
                ));
            }
            black_box(core.on(
                now,
                Input::Signal {
                    turn,
                    signal: Signal::Result(StopReason::EndTurn),
                },
            ));
        });
    });
    g.throughput(Throughput::Elements(UPDATES + 3));
    g.bench_function(
        "steered turn (steer, receipt, 1000 updates, result, stale idle)",
        |b| {
            let mut core: SessionCore = SessionCore::new(TurnConfig::default(), 0);
            let mut now = 0;
            b.iter(|| {
                now += 1;
                core.on(
                    now,
                    Input::Prompt {
                        prompt: PromptId::from_u128(now as u128),
                        origin: Origin::Interactive,
                        payload: (),
                    },
                );
                let turn = core.last_turn();
                let steer = SteerId::from_u128(now as u128);
                core.on(
                    now,
                    Input::Steer {
                        steer,
                        text: (),
                        idle_behavior: IdleBehavior::PromptRequired,
                    },
                );
                core.on(
                    now,
                    Input::Signal {
                        turn,
                        signal: Signal::SteerReceipt(steer, SteerReceipt::Consumed),
                    },
                );
                for _ in 0..UPDATES {
                    black_box(core.on(
                        now,
                        Input::Signal {
                            turn,
                            signal: Signal::Update,
                        },
                    ));
                }
                core.on(
                    now,
                    Input::Signal {
                        turn,
                        signal: Signal::Result(StopReason::EndTurn),
                    },
                );
                black_box(core.on(
                    now,
                    Input::Signal {
                        turn: TurnId(turn.0),
                        signal: Signal::Idle,
                    },
                ));
            });
        },
    );
    g.finish();
}

criterion_group!(benches, plain_turns);
criterion_main!(benches);
