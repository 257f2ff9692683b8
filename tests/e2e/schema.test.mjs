// The ACP schema check every e2e client runs (lib/schema.mjs) can fail,
// and checks against the schema the pinned SDK ships.

import { test } from "node:test";
import assert from "node:assert/strict";
import fs from "node:fs";
import { createRequire } from "node:module";
import { problems, schemaPath } from "./lib/schema.mjs";

const require = createRequire(import.meta.url);

test("the checked-in schema is the pinned SDK's official v1 schema.json", () => {
  const sdk = require.resolve("@agentclientprotocol/sdk/schema/v1/schema.json");
  assert.equal(fs.readFileSync(schemaPath, "utf8"), fs.readFileSync(sdk, "utf8"));
});

test("valid messages pass and invalid ones are reported", () => {
  const update = {
    jsonrpc: "2.0",
    method: "session/update",
    params: {
      sessionId: "s1",
      update: { sessionUpdate: "agent_message_chunk", content: { type: "text", text: "hi" }, messageId: "m1" },
    },
  };
  assert.deepEqual(problems(update), []);
  const noSession = structuredClone(update);
  delete noSession.params.sessionId;
  assert.notDeepEqual(problems(noSession), []);
  const badKind = structuredClone(update);
  badKind.params.update.sessionUpdate = "agent_message_chunkz";
  assert.notDeepEqual(problems(badKind), []);
  // Responses are checked against the method of the request they answer.
  const sent = new Map([[7, "session/prompt"]]);
  assert.notDeepEqual(problems({ jsonrpc: "2.0", id: 7, result: { stopReason: "finished" } }, sent), []);
  sent.set(8, "session/prompt");
  assert.deepEqual(problems({ jsonrpc: "2.0", id: 8, result: { stopReason: "end_turn" } }, sent), []);
  assert.notDeepEqual(problems({ jsonrpc: "2.0", id: 9, error: { message: "no code" } }), []);
  assert.notDeepEqual(problems({ jsonrpc: "2.0", method: "session/nonsense", params: {} }), []);
  assert.deepEqual(problems({ jsonrpc: "2.0", method: "_tiller/turn_settled", params: {} }), []);
});
