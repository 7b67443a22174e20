# Sourced by the GPU scripts: results under $OUT (or ./out), the checkout on PYTHONPATH, and the Python
# packages a machine without network lacks installed from ./.whl (benchmark/gpu_wheels.sh) when present,
# their commands (py-spy) on PATH. Child processes (servers) inherit all of it.
OUT=${OUT:-out}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl > /dev/null && export PYTHONPATH=$PYTHONPATH:/tmp/site PATH=/tmp/site/bin:$PATH
fi
