"""report.md: the same sections and numbers as report.html, as text (tables instead of figures)."""

from __future__ import annotations

from metronome.report import answer as A


def md_cell(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def md_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(md_cell(h) for h in header) + " |",
           "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(md_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def answer_markdown(data: dict) -> str:
    """The answer section alone (the README quotes it)."""
    from_live = data["options"].get("calibrations_from_live", False)
    parts = [A.headline(c) for c in data["calibrations"]]
    parts += [f"**{c['name']}, beside the live run.** {w}" for c in data["calibrations"]
              if (w := A.live_plan_words(c, from_live))]
    header, rows = A.answer_table(data)
    return "\n\n".join(parts + [md_table(header, rows)])


def render_markdown(data: dict) -> str:
    cals = data["calibrations"]
    s = [f"# {data['title']}", "",
         f"Built by `metronome-sim report` in {data['wall_s']:.0f} s ({data['simulated_runs']} simulated runs). "
         "The same numbers, with figures, are in report.html.", "",
         f"## {A.section_title(data, 'answer')}", "", answer_markdown(data), ""]
    tornado = A.tornado_tables(data)
    if tornado:
        s += [A.tornado_note(data), ""]
        for title, table in tornado:
            s += [f"**{title}**", "", md_table(*table), ""]
    s += [A.gpus_note(data), "", md_table(*A.gpus_table(data)), ""]
    if data.get("fleet"):
        s += [f"## {A.section_title(data, 'gpus')}", "", A.fleet_note(data), "", md_table(*A.fleet_table(data)), "",
              "Per hour of the run:", "", md_table(*A.fleet_hours_table(data["fleet"]["series"])), ""]
    s += [f"## {A.section_title(data, 'fill')}", "", A.fill_note(data), "", md_table(*A.fill_table(data)), ""]
    s += [f"## {A.section_title(data, 'metastability')}", "", A.metastability_note(data), ""]
    for title, table in A.metastability_tables(data):
        s += [f"**{title}**", "", md_table(*table), ""]
    s += [f"## {A.section_title(data, 'signal')}", "", A.signal_note(data), "", md_table(*A.signal_table(data)), ""]
    s += [f"## {A.section_title(data, 'admission')}", "", A.admission_note(data), "", md_table(*A.admission_table(data)), ""]
    s += [f"## {A.section_title(data, 'fidelity')}", ""]
    for c in cals:
        text, rows = A.fidelity(c)
        plan_words = A.live_plan_words(c, data["options"].get("calibrations_from_live", False))
        s += [f"**{c['name']}.** {text}" + (f" {plan_words}" if plan_words else ""), ""]
        if rows:
            s += [md_table(A.FIDELITY_HEADER, rows), ""]
    s += [f"## {A.section_title(data, 'provenance')}", ""]
    for c in cals:
        s += [f"**{c['name']}**", "", md_table(["field", "value"], [list(r) for r in A.provenance_rows(c)]), ""]
        if A.term_rows(c):
            s += ["Step-latency terms:", "", md_table(A.TERMS_HEADER, A.term_rows(c)), ""]
        if c["provenance"]["notes"]:
            s += ["How the numbers were derived:", ""] + [f"- {n}" for n in c["provenance"]["notes"]] + [""]
    s += [f"Seeds: {A.seeds_words(data)}. Versions: "
          + ", ".join(f"{k} {v}" for k, v in data["versions"].items()) + ".", "",
          "Reproduce (the report is the same on any executor and worker count):", "",
          "```bash", data["reproduce"], "```", ""]
    return "\n".join(s)
