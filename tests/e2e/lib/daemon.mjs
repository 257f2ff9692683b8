// Helpers that start the real `tiller` binary and connect real ACP clients
// (the official TypeScript SDK) over its three transports.

import { spawn } from "node:child_process";
import { createHash } from "node:crypto";
import { mkdtempSync, existsSync, readFileSync, rmSync } from "node:fs";
import net from "node:net";
import os from "node:os";
import path from "node:path";
import { Readable, Writable } from "node:stream";
import { fileURLToPath } from "node:url";

import { client, ndJsonStream } from "@agentclientprotocol/sdk";
import { validated } from "./schema.mjs";
import { createWebSocketStream } from "@agentclientprotocol/sdk/experimental/ws-client";

const here = path.dirname(fileURLToPath(import.meta.url));
export const repo = path.resolve(here, "../../..");
export const bin = process.env.TILLER_BIN ?? path.join(repo, "target/debug/tiller");

if (!existsSync(bin)) {
  throw new Error(`no tiller binary at ${bin}: run \`cargo build\` first (scripts/test does)`);
}

/**
 * With TILLER_TEST_POSTGRES_URL set (scripts/test runs the suite both
 * ways), a daemon keeps its store in PostgreSQL: one schema per data
 * directory, so a restart on the same directory finds its data and
 * daemons of different directories share nothing.
 */
export function storeEnv(dataDir) {
  const url = process.env.TILLER_TEST_POSTGRES_URL;
  if (!url) return {};
  const schema = `e2e_${createHash("sha256").update(path.resolve(dataDir)).digest("hex").slice(0, 16)}`;
  return { TILLER_STORE__KIND: "postgres", TILLER_STORE__SCHEMA: schema, TILLER_DATABASE_URL: url };
}

/** The directories this test file made, removed when it exits. */
const made = [];
process.on("exit", () => {
  for (const dir of made) {
    try {
      rmSync(dir, { recursive: true, force: true });
    } catch {
      // A test may leave a directory it cannot remove (no permission):
      // it stays, as before.
    }
  }
});

export function tempDir() {
  const dir = mkdtempSync(path.join(os.tmpdir(), "tiller-e2e-"));
  made.push(dir);
  return dir;
}

/** Short timers so the tests exercise every bound quickly. */
export const fastTimers = {
  TILLER_TURN__CANCEL_GRACE: "300ms",
  TILLER_TURN__STEER_RECEIPT_TIMEOUT: "300ms",
  TILLER_TURN__STALL_TIMEOUT: "3s",
};

/**
 * Starts `tiller serve` on a free port with its own data directory.
 * Resolves once the daemon logs that it is ready.
 */
export async function startDaemon({ dataDir = tempDir(), env = {}, args = [] } = {}) {
  const child = spawn(
    bin,
    ["serve", "--data-dir", dataDir, "--listen", "127.0.0.1:0", ...args],
    {
      env: { ...process.env, RUST_LOG: "info", ...fastTimers, ...storeEnv(dataDir), ...env },
      stdio: ["ignore", "ignore", "pipe"],
    },
  );
  let log = "";
  const listen = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`daemon did not start:\n${log}`)), 15000);
    child.stderr.on("data", (d) => {
      log += d.toString();
      const m = log.match(/tiller is ready listen=(\S+)/);
      if (m) {
        clearTimeout(timer);
        resolve(m[1]);
      }
    });
    child.on("exit", (code) => {
      clearTimeout(timer);
      reject(new Error(`daemon exited with ${code}:\n${log}`));
    });
  });
  const exited = new Promise((resolve) => child.on("exit", (code, signal) => resolve({ code, signal })));
  // The token TCP clients need: the configured one, or the one the daemon
  // generated into its data directory (none with server.auth = "none").
  const tokenFile = path.join(dataDir, "token");
  const token = env.TILLER_SERVER__TOKEN ?? (existsSync(tokenFile) ? readFileSync(tokenFile, "utf8").trim() : undefined);
  return {
    child,
    dataDir,
    token,
    tokenFile,
    auth: token ? { authorization: `Bearer ${token}` } : {},
    listen,
    http: `http://${listen}`,
    ws: `ws://${listen}/acp`,
    socket: path.join(dataDir, "tiller.sock"),
    log: () => log,
    exited,
    async stop(signal = "SIGTERM") {
      child.kill(signal);
      return exited;
    },
  };
}

/**
 * A client connection that records every notification it receives.
 * `conn.agent.request(...)` sends requests.
 */
export function connectStream(stream, onClose = () => {}, { editor = false } = {}) {
  const updates = [];
  const ext = [];
  const permissionRequests = [];
  const waiters = [];
  const notify = () => {
    for (const w of [...waiters]) w();
  };
  // Answers permission requests; tests replace it. Default: deny.
  const self = { answer: async () => ({ outcome: { outcome: "selected", optionId: "reject_once" } }) };
  // Requests for the client's fs/terminal methods; tests set `onClient`.
  const clientRequests = [];
  self.onClient = async (method) => {
    throw new Error(`${method} not supported by this test client`);
  };
  let app = client().onRequest("session/request_permission", async ({ params }) => {
    permissionRequests.push(params);
    notify();
    return self.answer(params);
  });
  // Only an "editor" client answers fs/terminal requests (registering the
  // handlers changes how the SDK orders its callbacks, so plain clients
  // keep the default set).
  for (const method of !editor ? [] : [
    "fs/read_text_file",
    "fs/write_text_file",
    "terminal/create",
    "terminal/output",
    "terminal/wait_for_exit",
    "terminal/kill",
    "terminal/release",
  ]) {
    app = app.onRequest(method, async ({ params }) => {
      clientRequests.push({ method, params });
      return self.onClient(method, params);
    });
  }
  app = app
    .onNotification("session/update", ({ params }) => {
      updates.push(params);
      notify();
    })
    .onNotification("*", ({ method, params }) => {
      ext.push({ method, params });
      notify();
    });
  const conn = app.connect(validated(stream));
  conn.closed.then(onClose, onClose);
  return Object.assign(self, {
    conn,
    agent: conn.agent,
    updates,
    ext,
    permissionRequests,
    clientRequests,
    request: (method, params) => conn.agent.request(method, params),
    notify: (method, params) => conn.agent.notify(method, params),
    /** Waits until `pred()` holds (re-checked on every notification). */
    async until(pred, ms = 5000) {
      if (pred()) return;
      await new Promise((resolve, reject) => {
        const timer = setTimeout(() => {
          waiters.splice(waiters.indexOf(check), 1);
          reject(new Error("condition not met in time"));
        }, ms);
        const check = () => {
          if (pred()) {
            clearTimeout(timer);
            waiters.splice(waiters.indexOf(check), 1);
            resolve();
          }
        };
        waiters.push(check);
      });
    },
    close: () => conn.close(),
  });
}

/** ACP over the daemon's unix socket. */
export async function connectUnix(daemon) {
  const sock = net.connect(daemon.socket);
  await new Promise((resolve, reject) => {
    sock.once("connect", resolve);
    sock.once("error", reject);
  });
  const stream = ndJsonStream(Writable.toWeb(sock), Readable.toWeb(sock));
  const c = connectStream(stream, () => sock.destroy());
  const close = c.close;
  c.close = () => {
    close();
    sock.destroy();
  };
  return c;
}

/**
 * Node's WebSocket takes headers in its init object; the SDK passes them
 * as a third argument (the `ws` package's form). This adapts one to the other.
 */
class HeaderWebSocket extends WebSocket {
  constructor(url, protocols, opts) {
    const headers = { ...(opts?.headers ?? {}) };
    super(url, protocols ? { protocols, headers } : { headers });
  }
}

/** A WebSocket stream to /acp, with the daemon's token unless `auth` says otherwise. */
export function wsStream(daemon, auth = daemon.auth) {
  return createWebSocketStream(daemon.ws, { WebSocket: HeaderWebSocket, headers: auth });
}

/** ACP over WebSocket at /acp. */
export async function connectWs(daemon) {
  return connectStream(wsStream(daemon));
}

/** An editor-like client over WebSocket: it also answers fs/* and terminal/*. */
export async function connectEditor(daemon) {
  return connectStream(wsStream(daemon), () => {}, { editor: true });
}

/** ACP over stdio, through `tiller acp` relaying to the daemon. */
export async function connectStdio(daemon, extraArgs = []) {
  const child = spawn(bin, ["acp", "--connect", `unix:${daemon.socket}`, ...extraArgs], {
    stdio: ["pipe", "pipe", "inherit"],
  });
  const stream = ndJsonStream(Writable.toWeb(child.stdin), Readable.toWeb(child.stdout));
  const c = connectStream(stream);
  const close = c.close;
  c.close = () => {
    close();
    child.kill();
  };
  c.child = child;
  return c;
}

export const transports = {
  stdio: connectStdio,
  unix: connectUnix,
  websocket: connectWs,
};

export async function initialize(c) {
  return c.request("initialize", { protocolVersion: 1, clientCapabilities: {} });
}

export async function newSession(c, cwd = "/tmp") {
  const res = await c.request("session/new", { cwd, mcpServers: [] });
  return res.sessionId;
}

export function script(steps) {
  return JSON.stringify({ script: steps });
}

export function textPrompt(sessionId, text) {
  return { sessionId, prompt: [{ type: "text", text }] };
}

/** Waits until a turn of `sessionId` started (`_tiller/turn_started`). */
export function turnStarted(c, sessionId) {
  // A turn that starts after this call: count the ones already seen, so an
  // earlier turn of the same session never satisfies the wait. Call it right
  // after sending the prompt (before any await), as every test does.
  const started = () => c.ext.filter((e) => e.method === "_tiller/turn_started" && e.params.sessionId === sessionId).length;
  const before = started();
  return c.until(() => started() > before);
}

/** The agent text a connection saw for a session, joined. */
export function agentText(c, sessionId) {
  return c.updates
    .filter((u) => u.sessionId === sessionId && u.update.sessionUpdate === "agent_message_chunk")
    .map((u) => u.update.content.text)
    .join("");
}

/** Raw newline-delimited JSON-RPC over the unix socket, for malformed input. */
export async function rawUnix(daemon) {
  const sock = net.connect(daemon.socket);
  await new Promise((resolve, reject) => {
    sock.once("connect", resolve);
    sock.once("error", reject);
  });
  let buf = "";
  const messages = [];
  const waiters = [];
  sock.on("data", (d) => {
    buf += d.toString();
    let i;
    while ((i = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, i);
      buf = buf.slice(i + 1);
      if (line.trim()) messages.push(JSON.parse(line));
      for (const w of [...waiters]) w();
    }
  });
  return {
    /** Every message received and not yet taken by `next`, in order. */
    messages,
    /** Stop and resume reading (the kernel's buffers fill, then the daemon's). */
    pause: () => sock.pause(),
    resume: () => sock.resume(),
    send: (text) => sock.write(text + "\n"),
    async next(pred = () => true, ms = 5000) {
      const find = () => {
        const i = messages.findIndex(pred);
        return i >= 0 ? messages.splice(i, 1)[0] : undefined;
      };
      const found = find();
      if (found) return found;
      return new Promise((resolve, reject) => {
        const timer = setTimeout(() => reject(new Error("no matching message")), ms);
        const check = () => {
          const m = find();
          if (m) {
            clearTimeout(timer);
            waiters.splice(waiters.indexOf(check), 1);
            resolve(m);
          }
        };
        waiters.push(check);
      });
    },
    close: () => sock.destroy(),
  };
}

/**
 * JSON over HTTP against the daemon's API, with its token (pass
 * `{authorization: undefined}` in `headers` to send none).
 */
export async function api(daemon, method, path, body, headers = {}) {
  const all = { "content-type": "application/json", ...daemon.auth, ...headers };
  for (const [k, v] of Object.entries(all)) if (v === undefined) delete all[k];
  const res = await fetch(`${daemon.http}${path}`, {
    method,
    headers: all,
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await res.text();
  return { status: res.status, body: text ? JSON.parse(text) : null };
}

/**
 * Opens the SSE stream of a session with a real HTTP client (fetch).
 * Returns { next(pred, ms), events, close }. Each event: {event, id, data}.
 */
/** One SSE event block (the text between blank lines): `{event, id, data}`, data unparsed. */
export function parseSseBlock(block) {
  const ev = { event: "message", id: undefined, data: "" };
  for (const line of block.split("\n")) {
    if (line.startsWith(":")) continue;
    const [k, ...rest] = line.split(":");
    const v = rest.join(":").replace(/^ /, "");
    if (k === "event") ev.event = v;
    else if (k === "id") ev.id = Number(v);
    else if (k === "data") ev.data += v;
  }
  return ev;
}

export async function openStream(daemon, sessionId, { after, lastEventId } = {}) {
  const ctl = new AbortController();
  const qs = after === undefined ? "" : `?after=${after}`;
  const headers = { ...daemon.auth, ...(lastEventId === undefined ? {} : { "last-event-id": String(lastEventId) }) };
  const res = await fetch(`${daemon.http}/api/sessions/${sessionId}/events${qs}`, {
    headers,
    signal: ctl.signal,
  });
  if (res.status !== 200) throw new Error(`stream: HTTP ${res.status}`);
  const events = [];
  const waiters = [];
  let ended = false;
  (async () => {
    const decoder = new TextDecoder();
    let buf = "";
    try {
      for await (const chunk of res.body) {
        buf += decoder.decode(chunk, { stream: true });
        let i;
        while ((i = buf.indexOf("\n\n")) >= 0) {
          const ev = parseSseBlock(buf.slice(0, i));
          buf = buf.slice(i + 2);
          if (!ev.data) continue;
          ev.data = JSON.parse(ev.data);
          events.push(ev);
          for (const w of [...waiters]) w();
        }
      }
    } catch {
      // aborted
    }
    ended = true;
    for (const w of [...waiters]) w();
  })();
  return {
    events,
    ended: () => ended,
    async until(pred, ms = 5000) {
      if (pred()) return;
      await new Promise((resolve, reject) => {
        const t = setTimeout(() => reject(new Error("stream condition not met")), ms);
        const check = () => {
          if (pred() || ended) {
            clearTimeout(t);
            waiters.splice(waiters.indexOf(check), 1);
            pred() ? resolve() : reject(new Error("stream ended"));
          }
        };
        waiters.push(check);
      });
    },
    close: () => ctl.abort(),
  };
}
