"""Benchmark helper: replay a kept history file by the history judgement's old rule and its current one.

For each run from the 6th on (min_runs 5), each host's declared figures against its own earlier passing runs (up
to `runs`, 20): the rule before `822dcba` (each figure alone: preflight.history.judge) and the current one (the
fleet's common drop taken out, Holm over every figure compared in the run). bench/healthy_fleet.py --history FILE
keeps such a file. Reads only; needs no root.

    python3 bench/replay_history.py /tmp/fleet.db

Sample output:

    run 6: compared 20; old rule named [('node02', 'compute', 'devices[cpu].mem_gbps', 0.823)]; new rule named [];
    fleet drift []; fleet factors {'compute:gemm_gflops': 0.96, 'compute:mem_gbps': 0.851, 'iperf3:median_gbps': 0.998}
    runs naming a host: old rule 2, new rule 0
"""
import sqlite3
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from preflight.history.baseline import Settings, declared, direction, drifts, judge, one_sided_p  # noqa: E402
from preflight.hostside.stats import holm  # noqa: E402


def main(db: str) -> int:
    con = sqlite3.connect(db)
    S = Settings()  # the [history] defaults
    runs = [r for (r,) in con.execute("select id from runs order by started")]
    rows = con.execute("""select m.run, h.name, n.check_name, n.key, m.value from metrics m join hosts h on h.id=m.host
                          join names n on n.id=m.name""").fetchall()
    status = {(r, h, c): s for r, h, c, s in con.execute(
        "select r.run, h.name, r.check_name, r.status from results r join hosts h on h.id = r.host")}
    vals = {}
    for run, host, check, key, value in rows:
        vals.setdefault((host, check, key), {})[run] = value
    old_named = new_named = 0
    for i, run in enumerate(runs):
        figs = []
        for (host, check, key), series in vals.items():
            d = direction(declared(check), key)
            if not d or run not in series:
                continue
            past = [series[r] for r in runs[:i] if r in series and status.get((r, host, check)) == "pass"][-S.runs:]
            figs.append((host, check, key, series[run], past, d))
        old = [(h, c, k, round(v / statistics.median(p), 3)) for h, c, k, v, p, d in figs if judge(v, p, d, S)]
        fleet = drifts(figs, S)
        fam = [(h, c, k, v, p, d, fleet.get((c, k))) for h, c, k, v, p, d in figs if len(p) >= S.min_runs]
        adj = holm([one_sided_p(dr.adjust(v, S) if dr else v, p, d, S) for h, c, k, v, p, d, dr in fam])
        new = [(h, c, k) for (h, c, k, v, p, d, dr), pa in zip(fam, adj)
               if judge(dr.adjust(v, S) if dr else v, p, d, S) and pa < S.max_p]
        notable = [(d.check, d.key, round(d.factor, 3), len(d.dropped)) for d in fleet.values() if d.notable(S)]
        factors = {f"{c}:{k.split('.')[-1]}": round(d.factor, 3) for (c, k), d in fleet.items()}
        old_named += bool(old)
        new_named += bool(new)
        print(f"run {i}: compared {len(fam)}; old rule named {old}; new rule named {new}; fleet drift {notable}; "
              f"fleet factors {factors}")
    print(f"runs naming a host: old rule {old_named}, new rule {new_named}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
