"""report.html: one self-contained page. plotly.js is inlined once in the head and every figure is a
div drawn by it, so the page opens offline and stays a few MB."""

from __future__ import annotations

import html

import plotly.io as pio
from plotly.offline import get_plotlyjs

from metronome.report import answer as A
from metronome.report.figures import BOUNDED, UNBOUNDED, all_figures

CSS = """
:root { --red: %(red)s; --blue: %(blue)s; --ink: #1d2330; --muted: #5b6475; --line: #e3e7ee; --bg: #f7f8fa; }
* { box-sizing: border-box; }
body { margin: 0; font: 15px/1.5 Inter, "Segoe UI", Helvetica, Arial, sans-serif; color: var(--ink); background: var(--bg); }
main { max-width: 1480px; margin: 0 auto; padding: 24px 32px 48px; }
header h1 { font-size: 26px; margin: 8px 0 4px; }
header .sub { color: var(--muted); margin: 0 0 12px; }
nav { display: flex; flex-wrap: wrap; gap: 6px 18px; padding: 8px 0 16px; border-bottom: 1px solid var(--line); }
nav a { color: var(--muted); text-decoration: none; font-size: 14px; }
nav a:hover { color: var(--ink); }
section { background: #fff; border: 1px solid var(--line); border-radius: 10px; padding: 18px 22px; margin: 18px 0; }
h2 { font-size: 20px; margin: 0 0 8px; }
p.note { color: #333b4a; max-width: 1150px; }
.headline { font-size: 17px; line-height: 1.55; margin: 6px 0 12px; padding: 10px 14px; border-left: 4px solid var(--blue);
  background: #f2f7fc; border-radius: 4px; max-width: 1250px; }
table { border-collapse: collapse; margin: 8px 0; font-size: 14px; }
th, td { border-bottom: 1px solid var(--line); padding: 6px 12px; text-align: left; vertical-align: top; }
th { background: #f1f3f7; font-weight: 600; }
table.answer { font-size: 15px; width: 100%%; }
table.answer td:first-child { font-weight: 600; white-space: nowrap; color: #333b4a; width: 210px; }
table.answer tr.key td { background: #f6faf3; font-weight: 600; }
table.answer tr.danger td:not(:first-child) { color: #a50f15; }
table.num td { font-variant-numeric: tabular-nums; }
details { margin: 8px 0; }
summary { cursor: pointer; color: var(--muted); }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px; font-weight: 600;
  vertical-align: middle; margin-left: 6px; }
.badge.estimated { background: #fff3cd; color: #7a5b00; } .badge.measured { background: #d8f3dc; color: #1b5e20; }
.key-red { color: var(--red); font-weight: 600; } .key-blue { color: var(--blue); font-weight: 600; }
pre { background: #f1f3f7; padding: 10px 12px; border-radius: 6px; overflow-x: auto; font-size: 13px; }
.grid2 { display: grid; grid-template-columns: repeat(auto-fit, minmax(420px, 1fr)); gap: 18px; }
.figure { margin: 6px 0; }
ul.notes { font-size: 13px; color: var(--muted); }
""" % {"red": UNBOUNDED, "blue": BOUNDED}

KEY_ROWS = {"which binds", A.INTERVAL_ROW, "recommended S, W", "recommended admission"}


def esc(s) -> str:
    return html.escape(str(s), quote=True)


def html_table(header: list[str], rows: list[list[str]], cls: str = "num", table_id: str | None = None,
               row_classes: list[str] | None = None) -> str:
    tid = f' id="{esc(table_id)}"' if table_id else ""
    out = [f'<table class="{esc(cls)}"{tid}><thead><tr>' + "".join(f"<th>{esc(h)}</th>" for h in header)
           + "</tr></thead><tbody>"]
    for i, r in enumerate(rows):
        rc = f' class="{row_classes[i]}"' if row_classes and row_classes[i] else ""
        out.append(f"<tr{rc}>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _figure(fig, key: str) -> str:
    div = pio.to_html(fig, full_html=False, include_plotlyjs=False, div_id=f"fig-{key}",
                      config={"displaylogo": False, "responsive": True}, default_height=f"{fig.layout.height}px")
    return f'<div class="figure" data-figure="{esc(key)}">{div}</div>'


def _numbers(header, rows, title="the numbers behind the figure") -> str:
    return f"<details><summary>{esc(title)}</summary>{html_table(header, rows)}</details>"


def render_html(data: dict) -> str:
    cals = data["calibrations"]
    figs = all_figures(data)
    badges = " ".join(f'<span class="badge {esc(c["provenance"]["kind"])}">{esc(c["name"])}: '
                      f'{esc(c["provenance"]["kind"])}</span>' for c in cals)
    body = [f"<header><h1>{esc(data['title'])}</h1>",
            f'<p class="sub">metronome-sim report · {data["simulated_runs"]} simulated runs in {data["wall_s"]:.0f} s · '
            f'<span class="key-red">red: unbounded KV</span> · <span class="key-blue">blue: the sink+window bound</span> '
            f'{badges}</p></header>',
            "<nav>" + "".join(f'<a href="#{k}">{esc(t)}</a>' for k, t in A.sections(data)) + "</nav>"]

    def h2(key: str) -> str:
        return f'<section id="{key}"><h2>{esc(A.section_title(data, key))}</h2>'

    from_live = data["options"].get("calibrations_from_live", False)
    live_words = "".join(f'<p class="note live-plan" data-calibration="{esc(c["name"])}"><b>{esc(c["name"])}, beside '
                         f'the live run.</b> {esc(w)}</p>' for c in cals if (w := A.live_plan_words(c, from_live)))
    header, rows = A.answer_table(data)
    # red only for a collapse: "no collapse" of the mix in red read as an alarm beside the pool-fill section's
    collapsed = any(c["unbounded_at_n_star"]["collapsed"] for c in cals)
    classes = ["key" if r[0] in KEY_ROWS else ("danger" if r[0] == "unbounded at N*" and collapsed else "")
               for r in rows]
    body.append(h2("answer")
                + "".join(f'<p class="headline" data-calibration="{esc(c["name"])}">{esc(A.headline(c))}</p>'
                          for c in cals)
                + live_words
                + html_table(header, rows, cls="answer", table_id="answer-table", row_classes=classes)
                + (f'<p class="note" id="tornado-note">{esc(A.tornado_note(data))}</p>'
                   + _figure(figs["tornado"], "tornado")
                   + "".join(_numbers(*tb, title=f"the numbers behind the figure: {t}")
                             for t, tb in A.tornado_tables(data)) if "tornado" in figs else "")
                + f'<p class="note">{esc(A.gpus_note(data))}</p>' + html_table(*A.gpus_table(data), table_id="gpus-table")
                + "</section>")

    if data.get("fleet"):
        fh, frows = A.fleet_table(data)
        body.append(h2("gpus") + f'<p class="note">{esc(A.fleet_note(data))}</p>'
                    + html_table(fh, frows, cls="answer", table_id="fleet-table") + _figure(figs["gpus"], "gpus")
                    + _numbers(*A.fleet_hours_table(data["fleet"]["series"]), title="per hour of the run") + "</section>")

    body.append(h2("fill") +
                f'<p class="note">{esc(A.fill_note(data))}</p>' + _figure(figs["fill"], "fill")
                + _numbers(*A.fill_table(data)) + "</section>")
    meta_tables = "".join(f"<p><b>{esc(t)}</b></p>{html_table(*tb)}" for t, tb in A.metastability_tables(data))
    body.append(h2("metastability") +
                f'<p class="note">{esc(A.metastability_note(data))}</p>' + _figure(figs["metastability"], "metastability")
                + f"<details><summary>the numbers behind the figure</summary>{meta_tables}</details></section>")
    body.append(h2("signal") +
                f'<p class="note">{esc(A.signal_note(data))}</p>' + _figure(figs["signal"], "signal")
                + _numbers(*A.signal_table(data)) + "</section>")
    body.append(h2("admission") +
                f'<p class="note">{esc(A.admission_note(data))}</p>' + _figure(figs["admission"], "admission")
                + html_table(*A.admission_table(data)) + "</section>")

    fid = []
    for c in cals:
        text, frows = A.fidelity(c)
        plan_words = A.live_plan_words(c, from_live)
        fid.append(f"<div><p><b>{esc(c['name'])}.</b> {esc(text)}{' ' + esc(plan_words) if plan_words else ''}</p>"
                   + (html_table(A.FIDELITY_HEADER, frows) if frows else "") + "</div>")
    live_fig = _figure(figs["live"], "live") if "live" in figs else ""
    body.append(h2("fidelity") + '<div class="grid2">' + "".join(fid) + "</div>"
                + live_fig + "</section>")

    prov = []
    for c in cals:
        notes = "".join(f"<li>{esc(n)}</li>" for n in c["provenance"]["notes"])
        prov.append(f"<div><p><b>{esc(c['name'])}</b></p>"
                    + html_table(["field", "value"], [list(r) for r in A.provenance_rows(c)], cls="plain")
                    + (f"<p>Step-latency terms</p>" + html_table(A.TERMS_HEADER, A.term_rows(c))
                       if A.term_rows(c) else "")
                    + (f"<details><summary>how the numbers were derived</summary><ul class='notes'>{notes}</ul></details>"
                       if notes else "") + "</div>")
    versions = ", ".join(f"{k} {v}" for k, v in data["versions"].items())
    body.append(h2("provenance") + '<div class="grid2">' + "".join(prov) + "</div>"
                f"<p>Seeds: {esc(A.seeds_words(data))}. Versions: {esc(versions)}.</p>"
                "<p>Reproduce (the report is the same on any executor and worker count):</p>"
                f"<pre id='reproduce'>{esc(data['reproduce'])}</pre></section>")

    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{esc(data['title'])}</title><style>{CSS}</style>"
            f"<script type=\"text/javascript\">{get_plotlyjs()}</script></head>"
            f"<body><main>{''.join(body)}</main></body></html>\n")
