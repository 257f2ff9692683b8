// The operators' kit end to end: Debian's real Prometheus server scrapes a
// live daemon with the shipped scrape config (deploy/prometheus/prometheus.yml,
// only the target and the token file changed) and rule file, and every
// dashboard panel's query and every alert expression is run against it over
// Prometheus's HTTP API. Prints each query's result (the figures in the note).

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { readFileSync, writeFileSync, copyFileSync } from "node:fs";
import net from "node:net";
import path from "node:path";
import { after, before, describe, test } from "node:test";

import { api, repo, script, startDaemon, tempDir } from "./lib/daemon.mjs";

const prometheusBin = process.env.PROMETHEUS_BIN ?? "/usr/bin/prometheus";

let daemon;
let prom;
let promUrl;
let promLog = "";

function freePort() {
  return new Promise((resolve) => {
    const s = net.createServer();
    s.listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

async function query(expr) {
  const url = `${promUrl}/api/v1/query?query=${encodeURIComponent(expr)}`;
  const res = await fetch(url);
  const body = await res.json();
  assert.equal(body.status, "success", `${expr}: ${JSON.stringify(body)}`);
  return body.data.result;
}

async function until(what, f, ms = 30000) {
  const end = Date.now() + ms;
  for (;;) {
    const v = await f();
    if (v) return v;
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}\n${promLog.slice(-3000)}`);
    await new Promise((r) => setTimeout(r, 250));
  }
}

async function settle(sid) {
  for (let i = 0; i < 1000; i++) {
    const res = await api(daemon, "GET", `/api/sessions/${sid}`);
    if (res.body.state === "idle") return;
    await new Promise((r) => setTimeout(r, 10));
  }
  throw new Error("never idle");
}

before(async () => {
  // One engine of each kind, so their series exist (at zero) too.
  const cfgDir = tempDir();
  const cfg = path.join(cfgDir, "tiller.toml");
  writeFileSync(
    cfg,
    `[engine.model]\nkind = "openai"\nbase_url = "http://127.0.0.1:9/v1"\nmodel = "m"\n` +
      `[engine.agent]\nkind = "acp"\ncommand = "/bin/false"\n`,
  );
  daemon = await startDaemon({ args: ["--config", cfg] });
  // The shipped config, pointed at this daemon, scraping every second.
  const dir = tempDir();
  const tokenFile = path.join(dir, "tiller-token");
  writeFileSync(tokenFile, daemon.token, { mode: 0o600 });
  const shipped = readFileSync(path.join(repo, "deploy/prometheus/prometheus.yml"), "utf8");
  assert.match(shipped, /127\.0\.0\.1:4141/);
  assert.match(shipped, /credentials_file: \/etc\/prometheus\/tiller-token/);
  const config = shipped
    .replace("127.0.0.1:4141", daemon.listen)
    .replace("/etc/prometheus/tiller-token", tokenFile)
    .replaceAll("15s", "1s");
  writeFileSync(path.join(dir, "prometheus.yml"), config);
  copyFileSync(path.join(repo, "deploy/prometheus/alerts.yml"), path.join(dir, "alerts.yml"));
  const port = await freePort();
  promUrl = `http://127.0.0.1:${port}`;
  prom = spawn(
    prometheusBin,
    [
      `--config.file=${path.join(dir, "prometheus.yml")}`,
      `--storage.tsdb.path=${path.join(dir, "tsdb")}`,
      `--web.listen-address=127.0.0.1:${port}`,
      "--web.enable-lifecycle",
    ],
    { stdio: ["ignore", "ignore", "pipe"] },
  );
  prom.stderr.on("data", (d) => (promLog += d.toString()));
  await until("Prometheus to answer", async () => (await fetch(`${promUrl}/-/ready`).catch(() => null))?.ok);
  await until("a first scrape of tiller", async () => (await query('up{job="tiller"}')).length === 1);
  // Traffic while Prometheus watches, so rates and latency quantiles have
  // values: a plain turn, a loop-stopped one, and a cancelled one.
  const sid = (await api(daemon, "POST", "/api/sessions", { cwd: "/work" })).body.id;
  const call = { name: "read_file", input: { path: "src/main.rs" }, output: "fn main() {}" };
  for (const steps of [[{ say: "hello" }], [{ tools: Array(6).fill(call) }]]) {
    const r = await api(daemon, "POST", `/api/sessions/${sid}/prompts`, { text: script(steps) });
    assert.equal(r.status, 202);
    await settle(sid);
  }
  const r = await api(daemon, "POST", `/api/sessions/${sid}/prompts`, { text: script([{ sleep_ms: 5000 }]) });
  assert.equal(r.status, 202);
  await new Promise((res) => setTimeout(res, 100));
  assert.equal((await api(daemon, "POST", `/api/sessions/${sid}/cancel`)).status < 300, true);
  await settle(sid);

  // Scrapes after the traffic, so rate() and increase() see it.
  await until("the traffic scraped", async () => {
    const r = await query('tiller_turns_settled_total{origin="interactive",outcome="cancelled"}[3s]');
    return r.length === 1 && r[0].values.length >= 2 && Number(r[0].values.at(-1)[1]) === 1;
  });
});

after(async () => {
  prom?.kill("SIGTERM");
  await daemon?.stop();
});

/** Dashboard variables, as Grafana would substitute them. */
function grafana(expr) {
  return expr.replaceAll("$job", "tiller").replaceAll("$__rate_interval", "1m");
}

function exprs(v, out = []) {
  if (Array.isArray(v)) v.forEach((x) => exprs(x, out));
  else if (v && typeof v === "object") {
    for (const [k, x] of Object.entries(v)) {
      if (k === "expr" && typeof x === "string") out.push(x);
      else exprs(x, out);
    }
  }
  return out;
}

function show(result) {
  return result
    .map((s) => `${JSON.stringify(s.metric)} ${s.value[1]}`)
    .join("; ")
    .slice(0, 400);
}

describe("Prometheus scrapes a live daemon", () => {
  test("the target is up, authenticated by the token file, and the series carry the documented labels", async () => {
    const up = await query('up{job="tiller"}');
    assert.equal(up.length, 1);
    assert.equal(up[0].value[1], "1", promLog.slice(-2000));

    const build = await query("tiller_build_info");
    assert.equal(build.length, 1);
    assert.match(build[0].metric.version, /^\d+\.\d+\.\d+/);
    assert.ok(build[0].metric.commit, "a commit label");

    const settled = await query('tiller_turns_settled_total{origin="interactive"}');
    const by = Object.fromEntries(settled.map((s) => [s.metric.outcome, Number(s.value[1])]));
    assert.equal(by.end_turn, 1, JSON.stringify(by));
    assert.equal(by.loop_detected, 1, JSON.stringify(by));
    assert.equal(by.cancelled, 1, JSON.stringify(by));
    // Pre-registered at zero: a series that never happened is still there.
    assert.equal(by.stalled, 0);
    const cron = await query('tiller_turns_settled_total{origin="cron",outcome="end_turn"}');
    assert.equal(cron.length, 1, "bounded label sets exist before their first event");

    const loops = await query("tiller_loop_detected_total");
    const byType = Object.fromEntries(
      loops.filter((s) => s.metric.origin === "interactive").map((s) => [s.metric.loop_type, Number(s.value[1])]),
    );
    assert.equal(byType.consecutive_identical_tool_calls, 1, JSON.stringify(byType));

    const cancels = await query("tiller_cancel_latency_seconds_count");
    assert.equal(Number(cancels[0].value[1]), 1);

    const rss = await query("process_resident_memory_bytes");
    assert.ok(Number(rss[0].value[1]) > 1e6);

    // Help text reaches Prometheus.
    const meta = await (await fetch(`${promUrl}/api/v1/metadata?metric=tiller_turns_settled_total`)).json();
    assert.match(meta.data.tiller_turns_settled_total[0].help, /Turns settled/);
  });

  test("every dashboard panel's query runs and returns series, from start-up", async () => {
    const dashboard = JSON.parse(readFileSync(path.join(repo, "deploy/grafana/tiller.json"), "utf8"));
    const panels = dashboard.panels.filter((p) => p.targets);
    assert.ok(panels.length >= 12);
    const empty = [];
    for (const p of panels) {
      for (const t of p.targets) {
        const result = await query(grafana(t.expr));
        console.log(`panel "${p.title}" [${t.legendFormat}]: ${grafana(t.expr)}\n  => ${show(result) || "(empty)"}`);
        if (result.length === 0) empty.push(`${p.title}: ${t.expr}`);
      }
    }
    // Every series exists from start-up, engines' included.
    assert.deepEqual(empty, [], "panels with no series");
  });

  test("every alert rule loads and evaluates, and none fires on a healthy daemon", async () => {
    const rules = await (await fetch(`${promUrl}/api/v1/rules`)).json();
    const loaded = rules.data.groups.flatMap((g) => g.rules);
    assert.ok(loaded.length >= 8, JSON.stringify(rules));
    await until("every rule evaluated", async () => {
      const r = await (await fetch(`${promUrl}/api/v1/rules`)).json();
      return r.data.groups.flatMap((g) => g.rules).every((x) => x.health === "ok");
    });
    for (const rule of loaded) {
      const result = await query(rule.query);
      console.log(`alert ${rule.name}: ${rule.query}\n  => ${show(result) || "(not firing)"}`);
      // On this healthy daemon nothing pages.
      assert.deepEqual(result, [], `${rule.name} fires on a healthy daemon`);
    }
  });
});
