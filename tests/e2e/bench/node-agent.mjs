// The Node reference agent for bench/prompts.mjs: an ACP agent on the
// official TypeScript SDK, no storage, that answers every prompt with three
// `agent_message_chunk`s and `end_turn`. Run by the benchmark, not by hand.
import { readFileSync } from "node:fs";
import { Readable, Writable } from "node:stream";
import { agent, ndJsonStream } from "@agentclientprotocol/sdk";

// With NODE_AGENT_SESSION_NEW (a file: `{result, commands}`), `session/new`
// answers what Tiller answered (modes, config options) under a new session
// id, then sends its command list; else just the id.
const same = process.env.NODE_AGENT_SESSION_NEW && JSON.parse(readFileSync(process.env.NODE_AGENT_SESSION_NEW, "utf8"));
let next = 0;
const app = agent()
  .onRequest("initialize", () => ({ protocolVersion: 1, agentCapabilities: {} }))
  .onRequest("session/new", ({ client }) => {
    const sessionId = `s${next++}`;
    if (!same) return { sessionId };
    // After the answer, as Tiller sends it.
    setImmediate(() => client.notify("session/update", { sessionId, update: same.commands }));
    return { ...same.result, sessionId };
  })
  .onRequest("session/prompt", async ({ params, client }) => {
    for (const text of ["one ", "two ", "three"]) {
      await client.notify("session/update", {
        sessionId: params.sessionId,
        update: { sessionUpdate: "agent_message_chunk", content: { type: "text", text } },
      });
    }
    return { stopReason: "end_turn" };
  })
  .onNotification("session/cancel", () => {});
const conn = app.connect(ndJsonStream(Writable.toWeb(process.stdout), Readable.toWeb(process.stdin)));
conn.closed.then(() => process.exit(0));
