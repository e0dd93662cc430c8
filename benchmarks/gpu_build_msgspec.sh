#!/usr/bin/env bash
# Builds msgspec for the device machine's Python from its source, into /tmp/site: that machine has
# no package index, and the only msgspec wheel here is for this machine's Python (3.11; the device
# had 3.12). Put the source's src/msgspec under .whl/msgspec-src/src/msgspec first, e.g. from a
# checkout of github.com/jcrist/msgspec: git archive HEAD src/msgspec | tar -x -C .whl/msgspec-src
set -eu
src=${1:-.whl/msgspec-src}/src/msgspec
inc=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
suffix=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
mkdir -p /tmp/site/msgspec
cp "$src"/*.py "$src"/*.pyi "$src"/py.typed /tmp/site/msgspec/
echo '__version__ = "0.0.0+src"' > /tmp/site/msgspec/_version.py  # setuptools-scm writes it in a real build
gcc -shared -fPIC -O2 -I"$inc" -I"$src" "$src/_core.c" -o "/tmp/site/msgspec/_core$suffix"
