// The Node reference agent for bench/prompts.mjs: an ACP agent on the
// official TypeScript SDK, no storage, that answers every prompt with three
// `agent_message_chunk`s and `end_turn`. Run by the benchmark, not by hand.
import { Readable, Writable } from "node:stream";
import { agent, ndJsonStream } from "@agentclientprotocol/sdk";

let next = 0;
const app = agent()
  .onRequest("initialize", () => ({ protocolVersion: 1, agentCapabilities: {} }))
  .onRequest("session/new", () => ({ sessionId: `s${next++}` }))
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
