{{/* The chart's name, overridable. */}}
{{- define "basin.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's full name: the release name alone when it already contains the chart's name. */}}
{{- define "basin.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Name of the operator's Deployment, ServiceAccount (when created), ClusterRole/Role and bindings. */}}
{{- define "basin.operator.fullname" -}}
{{- printf "%s-operator" (include "basin.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "basin.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "basin.operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "basin.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "basin.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: basin
{{- end -}}

{{/* The operator pod's selector: stable across upgrades (a Deployment's selector is immutable). */}}
{{- define "basin.operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "basin.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Namespaces the operator watches: none means every namespace (cluster-wide); a namespaced install
     without a list watches the release's namespace only. */}}
{{- define "basin.watchNamespaces" -}}
{{- if .Values.operator.watchNamespaces -}}
{{- toJson .Values.operator.watchNamespaces -}}
{{- else if .Values.rbac.namespaced -}}
{{- toJson (list .Release.Namespace) -}}
{{- else -}}
[]
{{- end -}}
{{- end -}}

{{/* True ("true") when the cluster serves the Prometheus Operator's API (or `--api-versions` says so). */}}
{{- define "basin.hasMonitoringApi" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" -}}true{{- end -}}
{{- end -}}

{{/* A DNS-1123 name from a file's base name (dashboards, alert files). */}}
{{- define "basin.fileObjectName" -}}
{{- $base := .file | base | trimSuffix (ext .file) | lower | replace "_" "-" | replace "." "-" | replace " " "-" -}}
{{- printf "%s-%s" .prefix $base | trunc 63 | trimSuffix "-" -}}
{{- end -}}
