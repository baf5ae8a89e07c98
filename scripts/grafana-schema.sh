#!/usr/bin/env bash
# Installs Grafana's own TypeScript schema of dashboards (npm @grafana/schema 13.2.3) and the TypeScript compiler
# (typescript 5.9.3) into a cache outside the repository, once, for tests/unit/test_grafana_schema.py, which
# type-checks dashboards/*.json with tsc. Versions and sha512 hashes are pinned by the package-lock.json below
# (`npm ci` checks them); after the first run nothing is fetched (the .installed stamp is written only once tsc runs
# and the schema's types are in place). Installs Debian's nodejs and npm when node is missing. Prints the folder
# (its node_modules/ holds @grafana/schema and typescript) on its last line; fails loudly when it cannot.
#
#   scripts/grafana-schema.sh        install if missing
set -euo pipefail

CACHE=${PAT_CACHE:-$HOME/.cache/pat-rlhf}
SCHEMA=13.2.3
TYPESCRIPT=5.9.3
OUT=$CACHE/grafana-schema-$SCHEMA

if ! command -v node >/dev/null || { [ ! -f "$OUT/.installed" ] && ! command -v npm >/dev/null; }; then
    "$(dirname "$0")/apt-install.sh" --no-install-recommends nodejs npm
fi

ready() {
    [ -f "$OUT/node_modules/@grafana/schema/dist/types/index.d.ts" ] && [ -f "$OUT/node_modules/typescript/bin/tsc" ] \
        && [ "$(node "$OUT/node_modules/typescript/bin/tsc" --version)" = "Version $TYPESCRIPT" ] \
        && [ "$(node -p "require('$OUT/node_modules/@grafana/schema/package.json').version")" = "$SCHEMA" ]
}

node -e 'const [a,b] = process.versions.node.split(".").map(Number); process.exit(a>14 || a==14 && b>=17 ? 0 : 1)' \
    || { echo "grafana-schema.sh: typescript $TYPESCRIPT needs node >= 14.17, not $(node --version)" >&2; exit 1; }

if [ -f "$OUT/.installed" ] && [ -d "$OUT/node_modules" ]; then echo "$OUT"; exit 0; fi

mkdir -p "$CACHE"
exec 9>"$CACHE/.grafana-schema.lock"  # one installer at a time (make test beside a pytest run)
flock 9
if [ -f "$OUT/.installed" ] && [ -d "$OUT/node_modules" ]; then echo "$OUT"; exit 0; fi
rm -rf "$OUT"
mkdir -p "$OUT"
cat > "$OUT/package.json" <<EOF
{
  "name": "pat-grafana-schema",
  "private": true,
  "description": "@grafana/schema and tsc for tests/unit/test_grafana_schema.py (scripts/grafana-schema.sh)",
  "dependencies": {
    "@grafana/schema": "$SCHEMA",
    "typescript": "$TYPESCRIPT"
  }
}
EOF
cat > "$OUT/package-lock.json" <<EOF
{
  "name": "pat-grafana-schema",
  "lockfileVersion": 3,
  "requires": true,
  "packages": {
    "": {
      "name": "pat-grafana-schema",
      "dependencies": {
        "@grafana/schema": "$SCHEMA",
        "typescript": "$TYPESCRIPT"
      }
    },
    "node_modules/@grafana/schema": {
      "version": "$SCHEMA",
      "resolved": "https://registry.npmjs.org/@grafana/schema/-/schema-$SCHEMA.tgz",
      "integrity": "sha512-rk8FEO7yuFfRTK/JD39747SZFQ+iCTQbpm6Mh2OjnqGx/g/uQQFx56t64eCLXWEyoR68ru4cigcGKrXk+ozrLg==",
      "license": "Apache-2.0"
    },
    "node_modules/typescript": {
      "version": "$TYPESCRIPT",
      "resolved": "https://registry.npmjs.org/typescript/-/typescript-$TYPESCRIPT.tgz",
      "integrity": "sha512-jl1vZzPDinLr9eUt3J/t7V6FgNEw9QjvBPdysz9KfQDD41fQrC2Y4vKQdiaUpFT4bXlb1RHhLpp8wtm6M5TgSw==",
      "license": "Apache-2.0",
      "bin": {
        "tsc": "bin/tsc",
        "tsserver": "bin/tsserver"
      },
      "engines": {
        "node": ">=14.17"
      }
    }
  }
}
EOF
(cd "$OUT" && npm ci --no-audit --no-fund --ignore-scripts --loglevel=error >&2) || {
    echo "grafana-schema.sh: npm ci of @grafana/schema@$SCHEMA typescript@$TYPESCRIPT failed (is registry.npmjs.org" \
         "reachable?)" >&2
    exit 1
}
ready || { echo "grafana-schema.sh: $OUT/node_modules lacks @grafana/schema $SCHEMA or typescript $TYPESCRIPT" >&2
           exit 1; }
touch "$OUT/.installed"
echo "$OUT"
