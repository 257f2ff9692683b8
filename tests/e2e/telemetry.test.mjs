// OpenTelemetry end to end: with `[telemetry] otlp_endpoint` set, the
// daemon exports its session, turn and tool-call spans over OTLP/HTTP
// (protobuf) to a collector (here a receiver that keeps what it is sent),
// with ids, origins and tool names but never prompt text, tool input or
// the model key. A daemon without the key sends nothing.

import assert from "node:assert/strict";
import { mkdirSync, writeFileSync } from "node:fs";
import http from "node:http";
import path from "node:path";
import { after, before, describe, test } from "node:test";

import { api, startDaemon, tempDir } from "./lib/daemon.mjs";
import { openai, startMockModel } from "./lib/mockmodel.mjs";

const KEY = "sk-otel-test-key-0123456789";

let mock;
let collector;
const received = [];

before(async () => {
  mock = await startMockModel();
  collector = http.createServer(async (req, res) => {
    const chunks = [];
    for await (const c of req) chunks.push(c);
    received.push({ path: req.url, type: req.headers["content-type"], body: Buffer.concat(chunks) });
    res.writeHead(200, { "content-type": "application/x-protobuf" }).end();
  });
  await new Promise((r) => collector.listen(0, "127.0.0.1", r));
});

after(async () => {
  collector?.close();
  await mock?.close?.();
});

async function run(configExtra) {
  const dir = tempDir();
  const work = path.join(dir, "work");
  mkdirSync(work);
  writeFileSync(path.join(work, "private-path.rs"), "fn main() {}\n");
  const config = path.join(dir, "tiller.toml");
  writeFileSync(
    config,
    `${configExtra}
[engine.mock]
kind = "openai"
base_url = "${mock.url}/v1"
model = "mock-1"
api_key_env = "TILLER_TEST_MODEL_KEY"
`,
  );
  const daemon = await startDaemon({
    dataDir: path.join(dir, "data"),
    args: ["--config", config],
    env: { TILLER_TEST_MODEL_KEY: KEY, OTEL_BSP_SCHEDULE_DELAY: "100", OTEL_SDK_DISABLED: "" },
  });
  const created = await api(daemon, "POST", "/api/sessions", { cwd: work, engine: "mock" });
  assert.equal(created.status, 201);
  const sid = created.body.id;
  mock.reply(
    { events: openai.tools([{ id: "call_1", name: "read_file", args: { path: "private-path.rs" } }]) },
    { events: openai.text("zebra-private-answer") },
  );
  const sent = await api(daemon, "POST", `/api/sessions/${sid}/prompts`, { text: "zebra-private-question" });
  assert.equal(sent.status, 202);
  for (let i = 0; ; i++) {
    const s = await api(daemon, "GET", `/api/sessions/${sid}`);
    if (s.body.state === "idle" && s.body.lastSeq > 3) break;
    assert.ok(i < 1000, "the turn never settled");
    await new Promise((r) => setTimeout(r, 10));
  }
  // Closing ends the session's span; stopping flushes what is left.
  assert.equal((await api(daemon, "DELETE", `/api/sessions/${sid}`)).status, 204);
  await daemon.stop();
  return sid;
}

describe("OpenTelemetry", () => {
  test("session, turn and tool-call spans reach the collector, without text, input or key", async () => {
    const sid = await run(`[telemetry]\notlp_endpoint = "http://127.0.0.1:${collector.address().port}"\n`);
    assert.ok(received.length > 0, "nothing reached the collector");
    for (const r of received) {
      assert.equal(r.path, "/v1/traces");
      assert.equal(r.type, "application/x-protobuf");
    }
    const all = Buffer.concat(received.map((r) => r.body)).toString("latin1");
    for (const needed of ["tiller", "session", "turn", "tool_call", "read_file", "call_1", sid, "interactive"]) {
      assert.ok(all.includes(needed), `no ${JSON.stringify(needed)} in the exported spans`);
    }
    for (const secret of ["zebra-private-question", "zebra-private-answer", "private-path.rs", KEY]) {
      assert.ok(!all.includes(secret), `${JSON.stringify(secret)} was exported`);
    }
  });

  test("without otlp_endpoint nothing is sent", async () => {
    received.length = 0;
    await run("");
    assert.deepEqual(received, []);
  });
});
