"""The report's plotly figures, calibrations side by side (one column each). Unbounded is always red,
the bound always blue; the fill model is a line, the simulator points."""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from metronome.report.answer import PAST_N_STAR, mc_sessions_labels

UNBOUNDED = "#d62728"
BOUNDED = "#1f77b4"
GREY = "#7f7f7f"
N_STAR = "#2ca02c"
# shades for several N: light (few sessions) to dark (many)
SHADES = {"unbounded": ["#fc9272", "#fb6a4a", "#de2d26", "#a50f15", "#67000d"],
          "bounded": ["#9ecae1", "#6baed6", "#3182bd", "#08519c", "#08306b"]}
COLOR = {"unbounded": UNBOUNDED, "bounded": BOUNDED}
FONT = dict(family="Inter, Segoe UI, Helvetica, Arial, sans-serif", size=13)
HEATMAP_SCALE = [[0.0, "#ffffff"], [0.05, "#fff5eb"], [0.3, "#fdae6b"], [0.7, "#e6550d"], [1.0, "#7f2704"]]


def _layout(fig: go.Figure, height: int, **kw) -> go.Figure:
    fig.update_layout(template="plotly_white", height=height, font=FONT, margin=dict(l=70, r=30, t=70, b=60),
                      legend=dict(orientation="h", yanchor="bottom", y=1.04, xanchor="left", x=0), **kw)
    fig.update_annotations(font_size=14)
    return fig


def _titles(cals: list[dict], rows: list[str]) -> list[str]:
    return [f"<b>{c['name']}</b> · {r}" for r in rows for c in cals]


def _policy_label(c: dict, key: str) -> str:
    return "unbounded" if key == "unbounded" else c["policy"]["describe"]


# ------------------------------------------------------------------------------------------ 1. how sure N* is
FAST = "#6a51a3"  # a term at its low: steps faster, N* up
SLOW = "#e6550d"  # a term at its high
TORNADO_BARS = 12  # the widest swings; the table under the figure lists every ranged term
TERM_LABEL = 44  # characters of a term's name on the axis (the hover and the table give it whole)


def _term_label(name: str) -> str:
    return name if len(name) <= TERM_LABEL else name[:TERM_LABEL - 1] + "…"


def tornado(data: dict) -> go.Figure | None:
    """The sensitivity (tornado) chart: per calibration (one row each: the terms' names need the width), each ranged
    step term of the answer's stack as a horizontal bar from the central deadline-bound N* to N* with that term alone
    at its low (faster) and at its high (slower), widest swing on top; the interval (every term at once) shaded
    behind, N* and the memory ceiling marked. None when no calibration has a ranged term."""
    cals = [c for c in data["calibrations"] if (c["capacity"].get("ranges") or {}).get("tornado")]
    if not cals:
        return None
    # N* and the interval are named in the titles: inside the plot their labels would sit on the bars' own numbers
    titles = []
    for c in cals:
        r = c["capacity"]["ranges"]
        slow, fast = r["deadline_n_star_interval_sessions"]
        cap = r["memory_ceiling_sessions"]
        # (the headline's interval is N*'s, capped by the memory ceiling; this one is the deadline-bound N*'s)
        capped = f" · memory caps N* at {cap:,}" if cap is not None and max(slow, fast) > cap else ""
        titles.append(f"<b>{c['name']}</b> · deadline-bound N* {r['deadline_n_star_sessions']:,} (green line), one "
                      f"term moved at a time · every term at once: {slow:,}–{fast:,} (shaded){capped}")
    counts = [min(len(c["capacity"]["ranges"]["tornado"]), TORNADO_BARS) for c in cals]
    fig = make_subplots(rows=len(cals), cols=1, subplot_titles=titles, vertical_spacing=0.24 / len(cals),
                        row_heights=[n + 2 for n in counts])
    for i, c in enumerate(cals, start=1):
        r = c["capacity"]["ranges"]
        bars = r["tornado"][:TORNADO_BARS]
        central = r["deadline_n_star_sessions"]
        labels = [_term_label(b["term"]) for b in bars]
        info = [[b["term"], b["basis"], f"{1e6 * b['value_s']:.3g}", f"{1e6 * b['low_s']:.3g}",
                 f"{1e6 * b['high_s']:.3g}", b["unit"][2:]] for b in bars]
        for key, name, color in (("low", "a term at its low (faster steps)", FAST),
                                 ("high", "a term at its high (slower steps)", SLOW)):
            ns = [b[f"deadline_n_star_at_{key}_sessions"] for b in bars]
            fig.add_trace(go.Bar(
                y=labels, x=[n - central for n in ns], base=central, orientation="h", name=name, legendgroup=key,
                showlegend=i == 1, marker=dict(color=color), text=[f"{n:,}" for n in ns], textposition="outside",
                cliponaxis=False, customdata=[row + [n] for row, n in zip(info, ns)],
                hovertemplate=("%{customdata[0]}<br>%{customdata[1]}: %{customdata[2]} µs %{customdata[5]} "
                               "(range %{customdata[3]}–%{customdata[4]})<br>at its " + key
                               + ": N* = %{customdata[6]:,}<extra></extra>")), i, 1)
        slow, fast = r["deadline_n_star_interval_sessions"]
        fig.add_vrect(x0=slow, x1=fast, fillcolor=GREY, opacity=0.13, line_width=0, layer="below", row=i, col=1)
        fig.add_vline(x=central, line=dict(color=N_STAR, width=2), row=i, col=1)
        ceiling = r["memory_ceiling_sessions"]
        if ceiling is not None and ceiling <= 1.1 * fast:  # labelled on the side away from the bars
            fig.add_vline(x=ceiling, line=dict(color=BOUNDED, dash="dot"), row=i, col=1,
                          annotation_text=f"memory ceiling {ceiling:,}", annotation_font_color=BOUNDED,
                          annotation_position="bottom right" if ceiling < central else "bottom left")
        lo = min([slow, ceiling or slow] + [b["deadline_n_star_at_high_sessions"] for b in bars])
        hi = max([fast, ceiling or fast] + [b["deadline_n_star_at_low_sessions"] for b in bars])
        pad = 0.08 * max(hi - lo, 1)
        fig.update_xaxes(title_text="deadline-bound N* (sessions)" if i == len(cals) else None,
                         range=[max(0, lo - pad), hi + pad], row=i, col=1)
        fig.update_yaxes(title_text="step term (widest swing on top)", autorange="reversed", type="category",
                         automargin=True, row=i, col=1)
    fig.update_layout(barmode="overlay", bargap=0.35)
    return _layout(fig, max(420, 90 + 34 * sum(counts) + 110 * len(cals)))


# ------------------------------------------------------------------------------------------ 2. pool fill
def pool_fill(data: dict) -> go.Figure:
    cals = data["calibrations"]
    fig = make_subplots(rows=2, cols=len(cals), shared_yaxes=True, vertical_spacing=0.14, horizontal_spacing=0.06,
                        subplot_titles=_titles(cals, ["unbounded", "bounded"]))
    for j, c in enumerate(cals, start=1):
        for i, key in enumerate(("unbounded", "bounded"), start=1):
            curves = [k for k in c["fill"]["curves"] if k["policy"] == key]
            for s, k in enumerate(curves):
                col = SHADES[key][min(s, len(SHADES[key]) - 1)]
                name = f"N={k['sessions']:,}"
                fig.add_trace(go.Scatter(x=k["t_line_s"], y=[100 * v for v in k["occupancy_predicted"]], mode="lines",
                                         line=dict(color=col, width=2), name=name, legendgroup="model",
                                         showlegend=False, hovertemplate=f"{name} fill model<br>%{{x:.0f}} s: %{{y:.1f}}%<extra></extra>"),
                              i, j)
                fig.add_trace(go.Scatter(x=k["t_sim_s"], y=[100 * v for v in k["occupancy_simulated"]], mode="markers",
                                         marker=dict(color=col, size=6, line=dict(color="white", width=0.5)), name=name,
                                         showlegend=False,
                                         hovertemplate=f"{name} simulated<br>%{{x:.0f}} s: %{{y:.1f}}%<extra></extra>"),
                              i, j)
                # the curve's label at its knee, where it reaches its final level (full pool or plateau)
                occ = k["occupancy_predicted"]
                knee = next(m for m, v in enumerate(occ) if v >= occ[-1] - 1e-9)
                fig.add_trace(go.Scatter(x=[k["t_line_s"][knee]], y=[100 * occ[knee]], mode="text", text=[name],
                                         textposition="top left" if s % 2 == 0 else "bottom right",
                                         textfont=dict(color=col, size=12),
                                         showlegend=False, hoverinfo="skip"), i, j)
                if k["t_sat_predicted_s"] is not None:
                    fig.add_vline(x=k["t_sat_predicted_s"], line=dict(color=col, dash="dot", width=1.5), row=i, col=j)
                if k["t_sat_observed_s"] is not None:
                    fig.add_trace(go.Scatter(x=[k["t_sat_observed_s"]], y=[100], mode="markers",
                                             marker=dict(symbol="x", size=11, color=col, line=dict(width=2)),
                                             showlegend=False,
                                             hovertemplate=f"{name}: pool ran dry at %{{x:.1f}} s (simulated)<extra></extra>"),
                                  i, j)
            fig.update_yaxes(title_text="pool occupancy (% of blocks)" if j == 1 else None, range=[0, 108], row=i, col=j)
            fig.update_xaxes(title_text="time since the sessions started (s)", row=i, col=j)
    for name, kw in (("fill model ρ(t)", dict(mode="lines", line=dict(color=GREY, width=2))),
                     ("simulated", dict(mode="markers", marker=dict(color=GREY, size=6))),
                     ("t_sat predicted (dotted)", dict(mode="lines", line=dict(color=GREY, dash="dot"))),
                     ("pool ran dry, simulated", dict(mode="markers", marker=dict(color=GREY, symbol="x", size=10)))):
        fig.add_trace(go.Scatter(x=[None], y=[None], name=name, **kw), 1, 1)
    return _layout(fig, 720)


# ------------------------------------------------------------------------------------------ 3. metastability
def metastability(data: dict) -> go.Figure:
    cals = data["calibrations"]
    titles = []
    for key in ("unbounded", "bounded"):
        for c in cals:
            lab = _policy_label(c, key)
            titles += [f"<b>{c['name']}</b> · {lab} · predicted", f"<b>{c['name']}</b> · {lab} · simulated"]
    fig = make_subplots(rows=2, cols=2 * len(cals), vertical_spacing=0.16, horizontal_spacing=0.045,
                        subplot_titles=titles)
    first = True
    for j, c in enumerate(cals):
        m = c["metastability"]
        xs = mc_sessions_labels(m)  # N past the deadline-bound N* carry a dagger (compute-overloaded)
        ys = [f"{d:g} s" for d in m["mean_duration_s"]]
        for i, key in enumerate(("unbounded", "bounded"), start=1):
            p = m["policies"][key]
            # the simulated share with its 95% Wilson interval and its runs, in the cell and on hover
            ci = [[f"{100 * lo:.0f}–{100 * hi:.0f}%" for lo, hi in row] for row in p["collapse_interval"]]
            extra = [[[a, r] for a, r in zip(ra, rr)] for ra, rr in zip(ci, p["runs"])]
            for k, (z, what, text) in enumerate((
                    (p["predicted"], "P(collapse), fill model", "%{z:.0%}"),
                    (p["simulated_collapse"], "collapsed", "%{z:.0%}<br><sub>%{customdata[0]}</sub>"))):
                fig.add_trace(go.Heatmap(
                    x=xs, y=ys, z=z, zmin=0, zmax=1, colorscale=HEATMAP_SCALE, showscale=first,
                    colorbar=dict(title=dict(text="probability", side="right"), tickformat=".0%", len=0.8),
                    texttemplate=text, textfont=dict(size=11), xgap=2, ygap=2, customdata=extra,
                    hovertemplate=(f"N=%{{x}} sessions<br>mean duration %{{y}}<br>{what}: %{{z:.0%}}"
                                   + ("<br>95% interval %{customdata[0]} of %{customdata[1]} runs" if k else "")
                                   + f"<br>({PAST_N_STAR}: past the deadline-bound N*)<extra></extra>")),
                    i, 2 * j + k + 1)
                first = False
                fig.update_xaxes(title_text="concurrent sessions N", type="category", row=i, col=2 * j + k + 1)
                fig.update_yaxes(title_text="mean session duration (s)" if (j == 0 and k == 0) else None,
                                 type="category", row=i, col=2 * j + k + 1)
    return _layout(fig, 760)


# ------------------------------------------------------------------------------------------ 4. the signal
def signal(data: dict) -> go.Figure:
    cals = data["calibrations"]
    fig = make_subplots(rows=2, cols=len(cals), vertical_spacing=0.14, horizontal_spacing=0.07,
                        subplot_titles=_titles(cals, ["frame latency against load", "silent frames against load"]))
    for j, c in enumerate(cals, start=1):
        for key in ("unbounded", "bounded"):
            s = c["signal"][key]
            lab = _policy_label(c, key)
            col = COLOR[key]
            show = j == 1
            fig.add_trace(go.Scatter(x=s["sessions"], y=[None if v is None else 1e3 * v for v in s["p99_frame_latency_s"]],
                                     mode="lines+markers", line=dict(color=col, width=2.5), name=f"{lab}: p99",
                                     legendgroup=f"{key}99", showlegend=show,
                                     hovertemplate=f"{lab}<br>N=%{{x}}: p99 %{{y:.1f}} ms<extra></extra>"), 1, j)
            fig.add_trace(go.Scatter(x=s["sessions"], y=[None if v is None else 1e3 * v for v in s["p50_frame_latency_s"]],
                                     mode="lines+markers", line=dict(color=col, width=1.5, dash="dash"),
                                     marker=dict(symbol="circle-open"), name=f"{lab}: p50", legendgroup=f"{key}50",
                                     showlegend=show,
                                     hovertemplate=f"{lab}<br>N=%{{x}}: p50 %{{y:.1f}} ms<extra></extra>"), 1, j)
            fig.add_trace(go.Scatter(x=s["sessions"], y=[100 * v for v in s["silent_frame_fraction"]], mode="lines+markers",
                                     line=dict(color=col, width=2.5), name=f"{lab}: silent frames",
                                     legendgroup=f"{key}silent", showlegend=show,
                                     hovertemplate=f"{lab}<br>N=%{{x}}: %{{y:.1f}}% of frames silent<extra></extra>"), 2, j)
            fig.add_trace(go.Scatter(x=s["sessions"], y=[100 * v for v in s["deadline_miss_fraction"]], mode="lines",
                                     line=dict(color=col, width=1.5, dash="dot"), name=f"{lab}: deadline misses",
                                     legendgroup=f"{key}miss", showlegend=show,
                                     hovertemplate=f"{lab}<br>N=%{{x}}: %{{y:.2f}}% deadline misses<extra></extra>"), 2, j)
        # (a log axis: the label is placed by hand, in log10 units)
        fig.add_hline(y=1e3 * c["deadline_s"], line=dict(color=GREY, dash="dash"), row=1, col=j)
        fig.add_annotation(x=0, xref="x domain" if j == 1 else f"x{j} domain", y=math.log10(1e3 * c["deadline_s"]),
                           yref="y" if j == 1 else f"y{j}", text=f"deadline {1e3 * c['deadline_s']:g} ms",
                           showarrow=False, xanchor="left", yanchor="bottom", font=dict(color=GREY))
        cap = c["capacity"]
        for r in (1, 2):
            # both memory ceilings stay marked when the grid (in units of N*) stops short of them, labelled once (in
            # the lower panel). An annotation's font without its text still makes an annotation, which plotly
            # draws as "new text": the upper panel's lines get neither.
            label = r == 2
            what = "max_num_seqs" if c.get("seqs_bind") else "memory ceiling"
            fig.add_vline(x=cap["memory_ceiling"], line=dict(color=BOUNDED, dash="dot"), row=r, col=j,
                          **(dict(annotation_text=f"{what} {cap['memory_ceiling']:,}", annotation_font_color=BOUNDED)
                             if label else {}))
            if c.get("memory_ceiling_unbounded"):
                fig.add_vline(x=c["memory_ceiling_unbounded"], line=dict(color=UNBOUNDED, dash="dot"), row=r, col=j,
                              **(dict(annotation_text=f"unbounded ceiling {c['memory_ceiling_unbounded']:,}",
                                      annotation_font_color=UNBOUNDED, annotation_position="top left")
                                 if label else {}))
            fig.add_vline(x=cap["n_star"], line=dict(color="#2ca02c", width=2), row=r, col=j)
        fig.add_annotation(x=cap["n_star"], y=1.0, yref="y domain" if j == 1 else f"y{j} domain",
                           xref="x" if j == 1 else f"x{j}", text=f"N* = {cap['n_star']:,}", showarrow=False,
                           xanchor="right", yanchor="top", font=dict(color="#2ca02c"))
        ticks = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
        fig.update_yaxes(title_text="frame latency (ms)", type="log", tickvals=ticks, ticktext=[f"{t:g}" for t in ticks],
                         row=1, col=j)
        fig.update_yaxes(title_text="share of frames (%)", rangemode="tozero", row=2, col=j)
        fig.update_xaxes(title_text="concurrent sessions N", row=2, col=j)
        fig.update_xaxes(title_text="concurrent sessions N", row=1, col=j)
    return _layout(fig, 760)


# ------------------------------------------------------------------------------------------ 5. admission
def admission(data: dict) -> go.Figure:
    cals = data["calibrations"]
    fig = make_subplots(rows=3, cols=len(cals), shared_xaxes=True, vertical_spacing=0.09, horizontal_spacing=0.07,
                        subplot_titles=_titles(cals, ["admission limit and sessions admitted",
                                                      "p99 frame latency per interval", "silent frames per interval"]))
    for j, c in enumerate(cals, start=1):
        a = c["admission"]
        # offered load: the pattern's rate x mean duration = the sessions it would keep busy
        t, y, start = [], [], 0.0
        for d, r in a["pattern"]:
            t += [start, start + d]
            y += [r * a["mean_duration_s"]] * 2
            start += d
        fig.add_trace(go.Scatter(x=t, y=y, mode="lines", line=dict(color=GREY, dash="dash", width=1.5),
                                 name="offered load (rate × mean duration)", showlegend=j == 1,
                                 hovertemplate="offered %{y:.0f} sessions<extra></extra>"), 1, j)
        for key in ("unbounded", "bounded"):
            tr = a["policies"][key]["trace"]
            lab = _policy_label(c, key)
            col = COLOR[key]
            show = j == 1
            fig.add_trace(go.Scatter(x=tr["t_s"], y=tr["limit"], mode="lines", line=dict(color=col, width=2),
                                     name=f"{lab}: AIMD limit", showlegend=show, legendgroup=f"{key}lim",
                                     hovertemplate=f"{lab}<br>%{{x:.0f}} s: limit %{{y}}<extra></extra>"), 1, j)
            fig.add_trace(go.Scatter(x=tr["t_s"], y=tr["in_flight"], mode="lines", line=dict(color=col, width=1.5, dash="dot"),
                                     name=f"{lab}: sessions admitted", showlegend=show, legendgroup=f"{key}inf",
                                     hovertemplate=f"{lab}<br>%{{x:.0f}} s: %{{y}} sessions<extra></extra>"), 1, j)
            fig.add_trace(go.Scatter(x=tr["t_s"], y=[None if v is None else 1e3 * v for v in tr["p_latency_s"]],
                                     mode="lines", line=dict(color=col, width=1.5), name=f"{lab}: p99", showlegend=False,
                                     hovertemplate=f"{lab}<br>%{{x:.0f}} s: p99 %{{y:.1f}} ms<extra></extra>"), 2, j)
            fig.add_trace(go.Scatter(x=tr["t_s"], y=[100 * v for v in tr["silent_fraction"]], mode="lines",
                                     line=dict(color=col, width=1.5), fill="tozeroy", name=f"{lab}: silent",
                                     showlegend=False,
                                     hovertemplate=f"{lab}<br>%{{x:.0f}} s: %{{y:.1f}}% silent<extra></extra>"), 3, j)
        fig.add_hline(y=1e3 * c["deadline_s"], line=dict(color=GREY, dash="dash"), row=2, col=j,
                      annotation_text=f"deadline {1e3 * c['deadline_s']:g} ms", annotation_position="top left")
        fig.update_yaxes(title_text="sessions", rangemode="tozero", row=1, col=j)
        fig.update_yaxes(title_text="p99 latency (ms)", rangemode="tozero", row=2, col=j)
        fig.update_yaxes(title_text="silent frames (%)", rangemode="tozero", row=3, col=j)
        fig.update_xaxes(title_text="simulated time (s)", row=3, col=j)
    return _layout(fig, 900)


# ------------------------------------------------------------------------------------------ 6. fidelity


def live_runs(data: dict) -> go.Figure | None:
    """Live admission runs (``--live`` run or benchmark folders) beside the simulator: admitted sessions and the
    controller's limit over time, one subplot per run (rows) and calibration (columns); None without such runs.
    Live in the policy's colour (red unbounded, blue bounded), simulated in grey; limits dotted; N* dashed."""
    cals = [c for c in data["calibrations"] if (c.get("live") or {}).get("kind") == "runs"]
    if not cals:
        return None
    per = [list(c["live"]["runs"].values()) for c in cals]
    n_rows = max(len(r) for r in per)
    titles = []
    for i in range(n_rows):
        for c, runs in zip(cals, per):
            r = runs[i] if i < len(runs) else None
            titles.append("" if r is None else f"<b>{c['name']}</b> · {r['label']}"
                          + (f" · N* = {r['n_star']:,}" if r.get("n_star") else ""))
    fig = make_subplots(rows=n_rows, cols=len(cals), vertical_spacing=min(0.14, 0.6 / n_rows),
                        horizontal_spacing=0.07, subplot_titles=titles)
    shown: set[str] = set()

    def once(name: str) -> bool:
        first = name not in shown
        shown.add(name)
        return first

    for j, runs in enumerate(per, start=1):
        for i, r in enumerate(runs, start=1):
            col = BOUNDED if r["bounded"] else UNBOUNDED
            lab = r["label"]
            for side, color, who in (("live", col, f"{lab}: live"), ("simulated", GREY, "simulated")):
                d = r.get(side)
                if d is None:
                    continue
                ses, lim = d["series"]["sessions"], d["series"]["limit"]
                name = f"{who} admitted"
                fig.add_trace(go.Scatter(x=ses["t_s"], y=ses["value"], mode="lines", name=name, legendgroup=name,
                                         line=dict(color=color, width=2.5 if side == "live" else 2),
                                         showlegend=once(name),
                                         hovertemplate=f"{lab} · {side}<br>%{{x:.0f}} s: %{{y:.1f}} sessions admitted"
                                                       "<extra></extra>"), i, j)
                if lim is not None:
                    name = f"{who} limit"
                    fig.add_trace(go.Scatter(x=lim["t_s"], y=lim["value"], mode="lines", name=name, legendgroup=name,
                                             line=dict(color=color, width=1.5, dash="dot", shape="hv"),
                                             showlegend=once(name),
                                             hovertemplate=f"{lab} · {side}<br>%{{x:.0f}} s: limit %{{y:.0f}}"
                                                           "<extra></extra>"), i, j)
            if r.get("n_star"):
                fig.add_hline(y=r["n_star"], line=dict(color=N_STAR, dash="dash", width=1.5), row=i, col=j,
                              annotation_text=f"N* = {r['n_star']:,}", annotation_position="top left",
                              annotation_font_color=N_STAR)
            fig.update_yaxes(title_text="sessions" if j == 1 else None, rangemode="tozero", row=i, col=j)
            fig.update_xaxes(title_text="time since the run started (s)", row=i, col=j)
    return _layout(fig, 120 + 340 * n_rows)


# ------------------------------------------------------------------------------------------ how many GPUs
def fleet(data: dict) -> go.Figure:
    """Over the offered load's run: the load, the GPUs running (static fleet, autoscaled mean) and the refusals."""
    series = data["fleet"]["series"]
    names = list(series)
    fig = make_subplots(rows=2, cols=len(names), shared_xaxes=True, vertical_spacing=0.12, horizontal_spacing=0.14,
                        specs=[[{"secondary_y": True}] * len(names), [{}] * len(names)],
                        subplot_titles=[f"<b>{n}</b> · {r}" for r in ("offered load and GPUs running",
                                                                     "refused at the door per hour")
                                        for n in names])
    for j, name in enumerate(names, start=1):
        sr = series[name]
        hours = [t / 3600 for t in sr["start_s"]]
        show = j == 1
        fig.add_trace(go.Scatter(x=hours, y=sr["offered_rate_per_s"], mode="lines", line=dict(color=GREY, width=1.5),
                                 line_shape="hv", name="offered load (sessions/s, right axis)", showlegend=show,
                                 hovertemplate="hour %{x:g}: %{y:.2f} sessions/s<extra></extra>"),
                      1, j, secondary_y=True)
        fig.add_trace(go.Scatter(x=hours, y=sr["static_engines"], mode="lines", line=dict(color=UNBOUNDED, dash="dash"),
                                 line_shape="hv", name="GPUs, static fleet sized for the peak", showlegend=show,
                                 hovertemplate="hour %{x:g}: %{y:.0f} GPUs (static)<extra></extra>"), 1, j)
        if sr["autoscaled_engines_mean"]:
            fig.add_trace(go.Scatter(x=hours, y=sr["autoscaled_engines_mean"], mode="lines",
                                     line=dict(color=BOUNDED, width=2), line_shape="hv",
                                     name="GPUs, autoscaled (mean over the hour)", showlegend=show,
                                     hovertemplate="hour %{x:g}: %{y:.1f} GPUs (autoscaled)<extra></extra>"), 1, j)
            fig.add_trace(go.Scatter(x=hours, y=[100 * v for v in sr["autoscaled_refused_fraction"]], mode="lines",
                                     line=dict(color=BOUNDED, width=2), line_shape="hv", name="refused, autoscaled",
                                     showlegend=show,
                                     hovertemplate="hour %{x:g}: %{y:.2f}% refused (autoscaled)<extra></extra>"), 2, j)
        fig.add_trace(go.Scatter(x=hours, y=[100 * v for v in sr["static_refused_fraction"]], mode="lines",
                                 line=dict(color=UNBOUNDED, dash="dash"), line_shape="hv", name="refused, static",
                                 showlegend=show,
                                 hovertemplate="hour %{x:g}: %{y:.2f}% refused (static)<extra></extra>"), 2, j)
        fig.add_hline(y=100 * data["fleet"]["summary"]["max_refusal"], line=dict(color=GREY, dash="dot"), row=2, col=j,
                      annotation_text="refusal target", annotation_position="top left")
        fig.update_yaxes(title_text="GPUs", rangemode="tozero", row=1, col=j, secondary_y=False)
        fig.update_yaxes(title_text="sessions/s", rangemode="tozero", row=1, col=j, secondary_y=True)
        fig.update_yaxes(title_text="refused (%)", rangemode="tozero", row=2, col=j)
        fig.update_xaxes(title_text="hour of the run", row=2, col=j)
    return _layout(fig, 640)


def all_figures(data: dict) -> dict[str, go.Figure]:
    """Figure key -> figure, in page order (``tornado``, in the answer's section, only when a term has a range;
    ``gpus`` only with an offered load, ``live`` only with live admission runs)."""
    sure = tornado(data)
    figs = {"tornado": sure} if sure is not None else {}
    if data.get("fleet"):
        figs["gpus"] = fleet(data)
    figs.update({"fill": pool_fill(data), "metastability": metastability(data), "signal": signal(data),
                 "admission": admission(data)})
    live = live_runs(data)
    if live is not None:
        figs["live"] = live
    return figs
