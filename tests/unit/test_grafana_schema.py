"""The Grafana dashboards (dashboards/*.json) type-checked against Grafana's own TypeScript schema: npm
@grafana/schema 13.2.3 with tsc 5.9.3 (installed once into ~/.cache/pat-rlhf by scripts/grafana-schema.sh, which
this test runs: it fails, never skips, where that cannot be done).

Each dashboard becomes `<name>.json.ts`, `export const dashboard: Checked = <the file's text>`, its JSON starting
on line 1, so tsc's line numbers are the JSON file's. All of them, and the negative controls, go through one tsc run
(--strict: fresh object literals get excess-property checks, so an unknown field is an error too).

Checked is @grafana/schema's Dashboard, narrowed where that package leaves a plugin's part open, each narrowing
taken from Grafana's own code: panels by their plugin's options and custom field config (the package's panelcfg
types; a panel type not in PANEL_PLUGINS fails until it is added there), panel and annotation targets as the
Prometheus plugin's query (grafana/grafana packages/grafana-prometheus/src/dataquery.gen.ts and types.ts: not in
@grafana/schema), the Prometheus annotation options that the plugin reads from the annotation itself (titleFormat,
tagKeys, textFormat, useValueForTime: annotations.ts, processEvents), and a query variable's `definition`
(@grafana/data's QueryVariableModel). Json<T> turns each TypeScript enum into the string values JSON holds.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))
SCRIPT = ROOT / "scripts" / "grafana-schema.sh"
TSC_FLAGS = ["--noEmit", "--strict", "--skipLibCheck", "--pretty", "false", "--target", "es2022", "--module", "esnext",
             "--moduleResolution", "bundler"]  # bundler: the package's exports map (its panelcfg subpaths)

_PANELCFG = "@grafana/schema/dist/esm/raw/composable/{0}/panelcfg/x/{1}PanelCfg_types.gen"
# panel type -> (its name in the panelcfg module's path, whether the plugin has a custom field config)
PANEL_PLUGINS = {"barchart": ("BarChart", True), "bargauge": ("BarGauge", False), "gauge": ("Gauge", False),
                 "heatmap": ("Heatmap", True), "histogram": ("Histogram", True), "piechart": ("PieChart", True),
                 "stat": ("Stat", False), "state-timeline": ("StateTimeline", True),
                 "status-history": ("StatusHistory", True), "table": ("Table", True), "text": ("Text", False),
                 "timeseries": ("TimeSeries", True), "trend": ("Trend", True), "xychart": ("XYChart", True)}


def _schema_ts() -> str:
    imports, panels = [], []
    for panel_type, (name, custom) in PANEL_PLUGINS.items():
        module = panel_type.replace("-", "")
        imports.append(f"import type * as {module} from '{_PANELCFG.format(module, name)}';")
        panels.append(f"  | PanelOf<'{panel_type}', {module}.Options" + (f", {module}.FieldConfig>" if custom else ">"))
    return "\n".join([
        "import type { AnnotationQuery, Dashboard, DataQuery, FieldConfig, FieldConfigSource, Panel, RowPanel,",
        "  VariableModel, VariableType } from '@grafana/schema';",
        *imports,
        "",
        "// JSON holds an enum's values: Json<T> is T with each string enum replaced by the union of its values.",
        "type Json<T> = T extends string ? `${T}` : T extends (infer U)[] ? Json<U>[]",
        "  : T extends object ? { [K in keyof T]: Json<T[K]> } : T;",
        "",
        "// The Prometheus plugin's query (grafana/grafana packages/grafana-prometheus/src/dataquery.gen.ts, and",
        "// interval from types.ts): @grafana/schema types panel targets as Record<string, unknown>, an annotation's",
        "// target as the bare DataQuery.",
        "interface PromQuery extends DataQuery {",
        "  editorMode?: 'builder' | 'code';",
        "  exemplar?: boolean;",
        "  expr: string;",
        "  format?: 'time_series' | 'table' | 'heatmap';",
        "  instant?: boolean;",
        "  interval?: string;",
        "  intervalFactor?: number;",
        "  legendFormat?: string;",
        "  legendUrlFormat?: string;",
        "  range?: boolean;",
        "  scope?: { matchers: string };",
        "}",
        "// The Prometheus plugin's annotation options, which it reads from the annotation itself, beside the target",
        "// (packages/grafana-prometheus/src/annotations.ts, processEvents; @grafana/data's AnnotationQuery admits any",
        "// key for them). Not its legacy top-level expr and step: those belong in target (expr, interval).",
        "interface PromAnnotation extends AnnotationQuery<PromQuery> {",
        "  titleFormat?: string;",
        "  tagKeys?: string;",
        "  textFormat?: string;",
        "  useValueForTime?: boolean;",
        "}",
        "// A panel of one plugin: its options and custom field config as the plugin's schema types them.",
        "type PanelOf<T extends string, O, F = Record<string, never>> =",
        "  Omit<Panel, 'type' | 'targets' | 'options' | 'fieldConfig'> & {",
        "    type: T;",
        "    targets?: PromQuery[];",
        "    options?: O;",
        "    fieldConfig?: Omit<FieldConfigSource, 'defaults'> & {",
        "      defaults: Omit<FieldConfig, 'custom'> & { custom?: F } };",
        "  };",
        "type AnyPanel =",
        *panels,
        "  ;",
        "type Row = Omit<RowPanel, 'panels'> & { panels: AnyPanel[] };",
        "// A query variable's definition: what the variable list shows (@grafana/data's QueryVariableModel).",
        "type Variable = (Omit<VariableModel, 'type'> & { type: 'query'; definition?: string })",
        "  | (Omit<VariableModel, 'type'> & { type: Exclude<VariableType, 'query'> });",
        "",
        "export type Checked = Json<Omit<Dashboard, 'panels' | 'annotations' | 'templating'> & {",
        "  panels?: Array<AnyPanel | Row>;",
        "  annotations?: { list?: PromAnnotation[] };",
        "  templating?: { list?: Variable[] };",
        "}>;",
        "",
    ])


SCHEMA_TS = _schema_ts()
HEADER = "import type { Checked } from './schema';  export const dashboard: Checked = "
_ERROR = re.compile(r"^(?P<file>[^()\s]+)\((?P<line>\d+),(?P<col>\d+)\): error (?P<code>TS\d+): (?P<message>.*)$")


@dataclass
class TscError:
    file: str  # the dashboard's name (rlhf-job.json) or schema.ts
    line: int  # a dashboard's: its JSON file's line
    col: int
    code: str
    message: str  # with tsc's elaboration lines
    text: str = ""  # the JSON line it points at

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}: {self.code} {self.text.strip()}\n    {self.message}"


def schema_dir() -> Path:
    """The folder scripts/grafana-schema.sh installs into (it installs on the first call; then only prints it)."""
    done = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and done.stdout.strip(), (
        f"{SCRIPT.relative_to(ROOT)} failed ({done.returncode}): it installs node and npm @grafana/schema + typescript "
        f"(registry.npmjs.org on its first run)\n{done.stdout}{done.stderr}")
    out = Path(done.stdout.strip().splitlines()[-1])
    assert (out / "node_modules" / "@grafana" / "schema").is_dir(), out
    return out


def typecheck(dashboards: dict[str, str], work: Path) -> tuple[list[TscError], float]:
    """tsc once over the dashboards ({name: JSON text}): every error, and the seconds tsc took."""
    tools = schema_dir()
    work.mkdir(parents=True, exist_ok=True)
    (work / "node_modules").symlink_to(tools / "node_modules", target_is_directory=True)
    (work / "schema.ts").write_text(SCHEMA_TS)
    lines = {}
    for name, text in dashboards.items():
        json.loads(text)
        (work / f"{name}.ts").write_text(HEADER + text)
        lines[name] = text.splitlines()
    start = time.monotonic()
    done = subprocess.run(["node", str(tools / "node_modules" / "typescript" / "bin" / "tsc"), *TSC_FLAGS, "schema.ts",
                           *(f"{name}.ts" for name in dashboards)],
                          cwd=work, capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - start
    errors: list[TscError] = []
    for row in done.stdout.splitlines():
        m = _ERROR.match(row)
        if m:
            name = m["file"].removesuffix(".ts")
            line = int(m["line"])
            text = lines[name][line - 1] if name in lines and line <= len(lines[name]) else ""
            errors.append(TscError(name, line, int(m["col"]), m["code"], m["message"], text))
        elif errors and row.startswith(" "):
            errors[-1].message += "\n    " + row.strip()
        elif row.strip():
            errors.append(TscError("?", 0, 0, "?", row))
    # tsc itself failing (a bad flag, a broken schema.ts) would leave the dashboards without errors: fail loudly.
    assert done.returncode in (0, 2) and (done.returncode == 0) == (not errors) \
        and all(e.file in dashboards for e in errors), f"tsc {done.returncode}:\n{done.stdout}{done.stderr}"
    return errors, seconds


# -- negative controls: one mistake each, in a copy of the RLHF job dashboard ----------------------------------------
def _timeseries(d: dict) -> dict:
    return next(p for p in d["panels"] if p["type"] == "timeseries")


def _height_as_string(d: dict) -> None:
    _timeseries(d)["gridPos"]["h"] = "8"


def _misspelt_target_field(d: dict) -> None:
    target = _timeseries(d)["targets"][0]
    target["legendFromat"] = target.pop("legendFormat")


def _unknown_legend_mode(d: dict) -> None:
    _timeseries(d)["options"]["legend"]["displayMode"] = "lists"


def _legacy_annotation(d: dict) -> None:  # what the dashboards held before: Grafana's old Prometheus annotation
    a = d["annotations"]["list"][0]
    target = a.pop("target")
    a["expr"], a["step"] = target["expr"], target["interval"]


def _empty_current(d: dict) -> None:
    d["templating"]["list"][0]["current"] = {}


# (name, mutation, the error code, what the error's JSON line or message must name)
CONTROLS = [("height-as-string", _height_as_string, "TS2322", '"h": "8"'),
            ("misspelt-target-field", _misspelt_target_field, "TS2353", '"legendFromat"'),
            ("unknown-legend-mode", _unknown_legend_mode, "TS2820", '"lists"'),
            ("legacy-annotation", _legacy_annotation, "TS2353", '"expr"'),
            ("empty-current", _empty_current, "TS2739", "text, value")]


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> tuple[dict[str, list[TscError]], float]:
    texts = {p.name: p.read_text() for p in DASHBOARDS}
    base = json.loads(texts["rlhf-job.json"])
    for name, mutate, _, _ in CONTROLS:
        d = json.loads(json.dumps(base))
        mutate(d)
        texts[f"control-{name}.json"] = json.dumps(d, indent=2) + "\n"
    errors, seconds = typecheck(texts, tmp_path_factory.mktemp("grafana-schema"))
    by_file: dict[str, list[TscError]] = {name: [] for name in texts}
    for error in errors:
        by_file[error.file].append(error)
    return by_file, seconds


def test_one_tsc_run_checks_every_dashboard(checked):
    by_file, seconds = checked
    assert DASHBOARDS and {p.name for p in DASHBOARDS} <= by_file.keys()
    assert seconds < 60, f"tsc took {seconds:.1f} s"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_matches_grafanas_schema(checked, path):
    errors = checked[0][path.name]
    assert not errors, f"dashboards/{path.name} against @grafana/schema:\n" + "\n".join(str(e) for e in errors)


@pytest.mark.parametrize("name, code, names", [(c[0], c[2], c[3]) for c in CONTROLS], ids=[c[0] for c in CONTROLS])
def test_a_mistake_is_caught_naming_the_field(checked, name, code, names):
    errors = checked[0][f"control-{name}.json"]
    assert len(errors) == 1, "\n".join(map(str, errors)) or "no error"
    error = errors[0]
    assert error.code == code and (names in error.text or names in error.message), str(error)

