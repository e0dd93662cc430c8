{{/* Names. Component names stay within 52 characters: a StatefulSet's pods add "-N" and the
controller-revision-hash label adds more, and label values end at 63. */}}
{{- define "mooncake.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "mooncake.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* dict "ctx" $ "component" "conductor" */}}
{{- define "mooncake.componentName" -}}
{{- printf "%s-%s" (include "mooncake.fullname" .ctx) .component | trunc 52 | trimSuffix "-" }}
{{- end }}

{{- define "mooncake.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "mooncake.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* dict "ctx" $ "component" "prefill" */}}
{{- define "mooncake.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mooncake.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "mooncake.componentLabels" -}}
{{ include "mooncake.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "mooncake.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The registry every process uses: the chart's etcd, or one outside it. A Kubernetes cluster
has no embedded registry: conductors and workers live in different pods, and several conductor
replicas must all see the same workers. */}}
{{- define "mooncake.etcdEndpoint" -}}
{{- if .Values.etcd.enabled }}
{{- printf "http://%s:2379" (include "mooncake.componentName" (dict "ctx" . "component" "etcd")) }}
{{- else }}
{{- required "etcd.externalEndpoint is required when etcd.enabled is false: conductors and workers find each other through etcd" .Values.etcd.externalEndpoint }}
{{- end }}
{{- end }}

{{- define "mooncake.secretName" -}}
{{- default (printf "%s-auth" (include "mooncake.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/* "true" when the conductor checks API keys (an empty string is false in templates). */}}
{{- define "mooncake.apiKeysEnabled" -}}
{{- if or .Values.auth.apiKeys (and .Values.auth.existingSecret .Values.auth.existingSecretHasApiKeys) }}true{{ end }}
{{- end }}

{{/* The --api-keys-file format: a key, then the models it may use (none: all). */}}
{{- define "mooncake.apiKeysFile" -}}
# Rendered by the chart from auth.apiKeys: KEY [MODEL,MODEL...]
{{- range .Values.auth.apiKeys }}
{{ required "every auth.apiKeys entry needs a key" .key }}{{ with .models }} {{ join "," . }}{{ end }}
{{- end }}
{{ end }}

{{- define "mooncake.secretsDir" -}}/etc/mooncake/secrets{{- end }}

{{/* Options every mooncake process shares; empty values leave the CLI's default
(mooncake/defaults.py is the one source of defaults). */}}
{{- define "mooncake.sharedArgs" -}}
{{- $m := .Values.model }}
{{- $args := list (printf "--etcd=%s" (include "mooncake.etcdEndpoint" .)) (printf "--cluster-token-file=%s/cluster-token" (include "mooncake.secretsDir" .)) }}
{{- with $m.path }}{{ $args = append $args (printf "--model=%s" .) }}{{ end }}
{{- with $m.servedModelName }}{{ $args = append $args (printf "--served-model-name=%s" .) }}{{ end }}
{{- with $m.dtype }}{{ $args = append $args (printf "--dtype=%s" .) }}{{ end }}
{{- with $m.maxModelLen }}{{ $args = append $args (printf "--max-model-len=%d" (int .)) }}{{ end }}
{{- with $m.blockSize }}{{ $args = append $args (printf "--block-size=%d" (int .)) }}{{ end }}
{{- with .Values.registry.ttlSeconds }}{{ $args = append $args (printf "--registry-ttl=%v" .) }}{{ end }}
{{- toYaml $args }}
{{- end }}

{{/* Volumes and mounts every mooncake pod has: the secrets, the model, the cache. */}}
{{- define "mooncake.commonVolumes" -}}
- name: secrets
  secret:
    secretName: {{ include "mooncake.secretName" .ctx }}
    defaultMode: 0440  # group-readable: with fsGroup a non-root process reads it
    items:
      - key: cluster-token
        path: cluster-token
      {{- if and (eq .component "conductor") (include "mooncake.apiKeysEnabled" .ctx) }}
      - key: api-keys
        path: api-keys
      {{- end }}
- name: cache
  emptyDir: {}
{{- with .ctx.Values.model.volume }}
- name: model
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "mooncake.commonMounts" -}}
- name: secrets
  mountPath: {{ include "mooncake.secretsDir" . }}
  readOnly: true
- name: cache
  mountPath: {{ .Values.model.cacheDir }}
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "mooncake.commonEnv" -}}
- name: MOONCAKE_CACHE_DIR
  value: {{ .Values.model.cacheDir | quote }}
- name: HF_HOME
  value: {{ printf "%s/huggingface" .Values.model.cacheDir | quote }}
{{- end }}

{{/* dict "ctx" $ "component" "prefill" "pool" $values: the pool's own affinity, or anti-affinity
across nodes (hard: never two on one node; soft: preferred). */}}
{{- define "mooncake.affinity" -}}
{{- if .pool.affinity }}
{{- toYaml .pool.affinity }}
{{- else if eq .pool.antiAffinity "hard" }}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: kubernetes.io/hostname
      labelSelector:
        matchLabels:
          {{- include "mooncake.selectorLabels" . | nindent 10 }}
{{- else if eq .pool.antiAffinity "soft" }}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "mooncake.selectorLabels" . | nindent 12 }}
{{- end }}
{{- end }}

{{/* Pod-level settings shared by the conductor and the pools. */}}
{{- define "mooncake.podScheduling" -}}
automountServiceAccountToken: false
{{- with .ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .pool.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .pool.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .pool.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (include "mooncake.affinity" .) }}
affinity:
  {{- . | trim | nindent 2 }}
{{- end }}
{{- with .pool.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
terminationGracePeriodSeconds: {{ int .pool.terminationGracePeriodSeconds }}
{{- end }}

{{/* Pod template metadata: labels, and a checksum of the auth values, so that a new token or
key list restarts the pods that read them. */}}
{{- define "mooncake.podMetadata" -}}
labels:
  {{- include "mooncake.selectorLabels" . | nindent 2 }}
  {{- with .pool.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
annotations:
  checksum/auth: {{ toJson .ctx.Values.auth | sha256sum }}
  {{- if .ctx.Values.metrics.scrapeAnnotations }}
  prometheus.io/scrape: "true"
  prometheus.io/path: /metrics
  prometheus.io/port: {{ .pool.port | int | quote }}
  {{- end }}
  {{- with .pool.podAnnotations }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}

{{/* The monitors' relabelling, so that series carry the labels deploy/prometheus/prometheus.yml
gives them: `job` mooncake-conductor or mooncake-worker whatever the release and monitor are
called (the InstanceDown alert and the dashboard select by job), and the workers' `role` (the
recording rules sum by it; the conductor's pods get none). */}}
{{- define "mooncake.monitorRelabelings" -}}
- sourceLabels: [__meta_kubernetes_pod_label_app_kubernetes_io_component]
  regex: conductor
  targetLabel: job
  replacement: mooncake-conductor
- sourceLabels: [__meta_kubernetes_pod_label_app_kubernetes_io_component]
  regex: (prefill|decode)
  targetLabel: job
  replacement: mooncake-worker
- sourceLabels: [__meta_kubernetes_pod_label_app_kubernetes_io_component]
  regex: (prefill|decode)
  targetLabel: role
{{- end }}
