// Command render renders a Helm chart's templates the way `helm template` does, for the subset
// of Helm the mooncake chart uses. There is no helm binary on the project's machines (none in
// Debian 12, none on PyPI), so the chart's tests render with this: the same Go text/template
// engine and the same sprig function library Helm uses, plus Helm's own additions (include,
// tpl, required, toYaml, fromYaml, lookup, .Files, .Capabilities).
//
// YAML goes through sigs.k8s.io/yaml, as in Helm. Build offline against Debian's Go packages:
//
//	GO111MODULE=off GOPATH=/usr/share/gocode go build -o render ./deploy/helm/render
//
// Usage: render [-f values.yaml]... [-name RELEASE] [-namespace NS] [-kube-version 1.30.0]
// [-api-versions monitoring.coreos.com/v1,...] [-cluster installed.yaml] [-show-values] CHART_DIR
//
// What Helm does and this does not: values.schema.json validation (the tests do it with
// jsonschema), --set, subcharts, hooks, NOTES.txt, .Files.Glob, and the kind-ordered output.
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"text/template"

	"github.com/Masterminds/sprig"
	"sigs.k8s.io/yaml"
)

type valueFiles []string

func (v *valueFiles) String() string     { return strings.Join(*v, ",") }
func (v *valueFiles) Set(s string) error { *v = append(*v, s); return nil }

// readYAML reads a values or Chart.yaml file as Helm does (sigs.k8s.io/yaml, through JSON:
// string keys, and every number a float64).
func readYAML(path string) (map[string]interface{}, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	m := map[string]interface{}{}
	if err := yaml.Unmarshal(data, &m); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if m == nil {
		m = map[string]interface{}{}
	}
	return m, nil
}

// merge lays src over dst as Helm coalesces a -f file over the chart's values: maps merge key
// by key, anything else replaces, and a null deletes the chart's default.
func merge(dst, src map[string]interface{}) {
	for k, v := range src {
		if v == nil {
			delete(dst, k)
			continue
		}
		sm, sok := v.(map[string]interface{})
		dm, dok := dst[k].(map[string]interface{})
		if sok && dok {
			merge(dm, sm)
		} else {
			dst[k] = v
		}
	}
}

// toYAML, fromYAML and fromYAMLArray are Helm's own (helm/pkg/engine/funcs.go).
func toYAML(v interface{}) string {
	data, err := yaml.Marshal(v)
	if err != nil {
		return ""
	}
	return strings.TrimSuffix(string(data), "\n")
}

func fromYAML(s string) map[string]interface{} {
	m := map[string]interface{}{}
	if err := yaml.Unmarshal([]byte(s), &m); err != nil {
		m["Error"] = err.Error()
	}
	return m
}

func fromYAMLArray(s string) []interface{} {
	a := []interface{}{}
	if err := yaml.Unmarshal([]byte(s), &a); err != nil {
		a = []interface{}{err.Error()}
	}
	return a
}

// readObjects reads the objects lookup may find: a multi-document YAML file, or none.
func readObjects(path string) ([]map[string]interface{}, error) {
	if path == "" {
		return nil, nil
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var objects []map[string]interface{}
	for _, doc := range strings.Split(string(data), "\n---") {
		var m map[string]interface{}
		if err := yaml.Unmarshal([]byte(doc), &m); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		if m != nil {
			objects = append(objects, m)
		}
	}
	return objects, nil
}

// Files is the chart's .Files: paths relative to the chart, symlinks followed (as Helm's loader does).
type Files struct{ root string }

func (f Files) Get(name string) string {
	data, err := os.ReadFile(filepath.Join(f.root, name))
	if err != nil {
		return "" // Helm returns "" for a file the chart lacks
	}
	return string(data)
}

type KubeVersion struct{ Version, Major, Minor string }
type APIVersions []string

func (a APIVersions) Has(v string) bool {
	for _, x := range a {
		if x == v {
			return true
		}
	}
	return false
}

func main() {
	var files valueFiles
	flag.Var(&files, "f", "values file (repeat; later ones win)")
	name := flag.String("name", "mooncake", "release name")
	namespace := flag.String("namespace", "default", "release namespace")
	kube := flag.String("kube-version", "1.30.0", "Kubernetes version for .Capabilities")
	apis := flag.String("api-versions", "", "extra API versions for .Capabilities.APIVersions.Has (comma-separated)")
	cluster := flag.String("cluster", "", "a YAML file of objects that lookup finds (as if installed); default: none, as in `helm template`")
	showValues := flag.Bool("show-values", false, "print the merged values as JSON (what the templates see) and stop")
	flag.Parse()
	if flag.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: render [-f values.yaml]... CHART_DIR")
		os.Exit(2)
	}
	if err := render(flag.Arg(0), files, *name, *namespace, *kube, *apis, *cluster, *showValues); err != nil {
		fmt.Fprintln(os.Stderr, "Error:", err)
		os.Exit(1)
	}
}

func render(chartDir string, files []string, release, namespace, kube, apis, cluster string, showValues bool) error {
	chart, err := readYAML(filepath.Join(chartDir, "Chart.yaml"))
	if err != nil {
		return err
	}
	values, err := readYAML(filepath.Join(chartDir, "values.yaml"))
	if err != nil {
		return err
	}
	for _, f := range files {
		user, err := readYAML(f)
		if err != nil {
			return err
		}
		merge(values, user)
	}
	if showValues {
		return json.NewEncoder(os.Stdout).Encode(values)
	}
	parts := strings.SplitN(kube, ".", 3)
	available := APIVersions{"v1", "apps/v1", "policy/v1", "networking.k8s.io/v1"}
	if apis != "" {
		available = append(available, strings.Split(apis, ",")...)
	}
	chartName := fmt.Sprint(chart["name"])
	top := map[string]interface{}{
		"Values": values,
		"Chart": map[string]interface{}{"Name": chartName, "Version": chart["version"],
			"AppVersion": chart["appVersion"], "Description": chart["description"]},
		"Release": map[string]interface{}{"Name": release, "Namespace": namespace, "Service": "Helm",
			"IsInstall": true, "IsUpgrade": false, "Revision": 1},
		"Files": Files{root: chartDir},
		"Capabilities": map[string]interface{}{
			"KubeVersion": KubeVersion{Version: "v" + kube, Major: parts[0], Minor: parts[1]},
			"APIVersions": available},
	}

	t := template.New(chartName)
	funcs := sprig.TxtFuncMap()
	delete(funcs, "env") // Helm removes these two: a chart must not read the renderer's environment
	delete(funcs, "expandenv")
	funcs["toYaml"] = toYAML
	funcs["fromYaml"] = fromYAML
	funcs["fromYamlArray"] = fromYAMLArray
	funcs["include"] = func(name string, data interface{}) (string, error) {
		var buf bytes.Buffer
		err := t.ExecuteTemplate(&buf, name, data)
		return buf.String(), err
	}
	funcs["tpl"] = func(text string, data interface{}) (string, error) {
		clone, err := t.Clone()
		if err != nil {
			return "", err
		}
		inline, err := clone.New("tpl").Parse(text)
		if err != nil {
			return "", err
		}
		var buf bytes.Buffer
		err = inline.Execute(&buf, data)
		return buf.String(), err
	}
	funcs["required"] = func(msg string, v interface{}) (interface{}, error) {
		if v == nil || v == "" {
			return nil, errors.New(msg)
		}
		return v, nil
	}
	installed, err := readObjects(cluster)
	if err != nil {
		return err
	}
	funcs["lookup"] = func(apiVersion, kind, ns, name string) map[string]interface{} {
		for _, obj := range installed {
			meta, _ := obj["metadata"].(map[string]interface{})
			if obj["apiVersion"] == apiVersion && obj["kind"] == kind && meta["namespace"] == ns && meta["name"] == name {
				return obj
			}
		}
		return map[string]interface{}{} // what Helm's lookup returns for an object that is not there
	}
	t.Funcs(funcs).Option("missingkey=zero")

	paths, err := filepath.Glob(filepath.Join(chartDir, "templates", "*"))
	if err != nil {
		return err
	}
	sort.Strings(paths)
	var names []string
	for _, p := range paths {
		base := filepath.Base(p)
		if base == "NOTES.txt" {
			continue
		}
		text, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		tname := chartName + "/templates/" + base
		if _, err := t.New(tname).Parse(string(text)); err != nil {
			return err
		}
		if !strings.HasPrefix(base, "_") {
			names = append(names, tname)
		}
	}
	for _, tname := range names {
		data := map[string]interface{}{}
		for k, v := range top {
			data[k] = v
		}
		data["Template"] = map[string]interface{}{"Name": tname, "BasePath": chartName + "/templates"}
		var buf bytes.Buffer
		if err := t.ExecuteTemplate(&buf, tname, data); err != nil {
			return err
		}
		out := strings.ReplaceAll(buf.String(), "<no value>", "")
		if strings.TrimSpace(out) != "" {
			fmt.Printf("---\n# Source: %s\n%s\n", tname, strings.TrimSpace(out))
		}
	}
	return nil
}
