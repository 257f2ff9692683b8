// A small MCP server built with the official TypeScript SDK, for the
// engines tests. Run as a script it serves stdio; `startMcpHttp()` serves
// streamable HTTP in-process.

import http from "node:http";
import { fileURLToPath } from "node:url";

import { McpServer } from "@modelcontextprotocol/sdk/server/mcp.js";
import { StdioServerTransport } from "@modelcontextprotocol/sdk/server/stdio.js";
import { StreamableHTTPServerTransport } from "@modelcontextprotocol/sdk/server/streamableHttp.js";
import { z } from "zod";

export const mcpServerPath = fileURLToPath(import.meta.url);

function build(calls) {
  const server = new McpServer({ name: "tiller-test-mcp", version: "1.0.0" });
  server.registerTool(
    "add",
    {
      description: "Add two numbers",
      inputSchema: { a: z.number(), b: z.number() },
      annotations: { readOnlyHint: true },
    },
    async ({ a, b }) => {
      calls?.push({ tool: "add", a, b });
      return { content: [{ type: "text", text: `sum=${a + b}` }] };
    },
  );
  server.registerTool(
    "fail",
    { description: "Always fails", inputSchema: {}, annotations: { readOnlyHint: true } },
    async () => ({ content: [{ type: "text", text: "it broke" }], isError: true }),
  );
  return server;
}

/** Streamable HTTP (stateless) on a free port; `calls` records tool calls. */
export async function startMcpHttp() {
  const calls = [];
  const httpServer = http.createServer(async (req, res) => {
    let raw = "";
    for await (const c of req) raw += c;
    const server = build(calls);
    const transport = new StreamableHTTPServerTransport({ sessionIdGenerator: undefined });
    res.on("close", () => {
      transport.close();
      server.close();
    });
    await server.connect(transport);
    await transport.handleRequest(req, res, raw ? JSON.parse(raw) : undefined);
  });
  await new Promise((r) => httpServer.listen(0, "127.0.0.1", r));
  return {
    url: `http://127.0.0.1:${httpServer.address().port}/mcp`,
    calls,
    close: () =>
      new Promise((r) => {
        httpServer.closeAllConnections();
        httpServer.close(r);
      }),
  };
}

if (process.argv[1] === mcpServerPath) {
  await build(null).connect(new StdioServerTransport());
}
