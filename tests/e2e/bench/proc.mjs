// CPU a process has used, for the benchmarks (Linux /proc).

import { readdirSync, readFileSync } from "node:fs";

const TICK_NS = 1e7; // USER_HZ = 100

/** CPU the process has used, in ns: every live thread's schedstat, or its
 * utime+stime (which also counts threads that ended) when that is larger. */
export function cpuNs(pid) {
  let sched = 0;
  for (const tid of readdirSync(`/proc/${pid}/task`)) {
    try {
      sched += Number(readFileSync(`/proc/${pid}/task/${tid}/schedstat`, "utf8").split(" ")[0]);
    } catch {}
  }
  const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
  const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
  const ticks = Number(fields[11]) + Number(fields[12]);
  return Math.max(sched, ticks * TICK_NS);
}
