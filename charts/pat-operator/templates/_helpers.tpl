{{- define "pat.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "pat.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pat.labels" -}}
{{ include "pat.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pat.serviceAccountName" -}}
{{ .Values.serviceAccount.name | default (include "pat.fullname" .) }}
{{- end -}}

{{- define "pat.tokenKeySecret" -}}
{{ .Values.tokenKey.existingSecret | default (printf "%s-token-key" (include "pat.fullname" .)) }}
{{- end -}}
