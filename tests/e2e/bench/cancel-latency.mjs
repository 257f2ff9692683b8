// Measures session/cancel -> `cancelled` latency end to end, through the
// official ACP SDK over the unix socket against the real daemon.
//   node bench/cancel-latency.mjs [iterations]
// Two cases: an engine that honours abort (sleep_ms), and a `hang` engine
// that ignores it, which the daemon tears down after turn.cancel_grace.
// Prints p50/p99/max in ms. Not a test: it asserts nothing about speed.

import { initialize, newSession, script, startDaemon, textPrompt, transports } from "../lib/daemon.mjs";

const n = Number(process.argv[2] ?? 200);
const grace = process.env.TILLER_TURN__CANCEL_GRACE ?? "300ms";
const daemon = await startDaemon({ env: { TILLER_TURN__CANCEL_GRACE: grace, RUST_LOG: "warn,tiller::daemon=info" } });
const c = await transports.unix(daemon);
await initialize(c);

async function measure(steps, iterations) {
  const sid = await newSession(c);
  const samples = [];
  for (let i = 0; i < iterations; i++) {
    const before = c.updates.length;
    const pending = c.request("session/prompt", textPrompt(sid, script(steps)));
    await c.until(() => c.updates.slice(before).some((u) => u.sessionId === sid && u.update.sessionUpdate === "user_message_chunk"));
    const t0 = performance.now();
    await c.notify("session/cancel", { sessionId: sid });
    const res = await pending;
    samples.push(performance.now() - t0);
    if (res.stopReason !== "cancelled") throw new Error(`got ${res.stopReason}`);
  }
  samples.sort((a, b) => a - b);
  const q = (p) => samples[Math.min(samples.length - 1, Math.floor(p * samples.length))].toFixed(2);
  return `p50 ${q(0.5)} ms  p99 ${q(0.99)} ms  max ${samples.at(-1).toFixed(2)} ms  (n=${iterations})`;
}

console.log(`cancel -> cancelled, abort honoured (sleep_ms): ${await measure([{ sleep_ms: 60000 }], n)}`);
console.log(`cancel -> cancelled, engine hangs (grace ${grace}): ${await measure([{ hang: true }], Math.max(10, Math.floor(n / 10)))}`);
c.close();
await daemon.stop();
